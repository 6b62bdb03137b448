"""What distcheck knows of the world outside it, as pure data and functions: how torch and its
libraries issue the collectives a user never wrote (``library_shapes``) and nccl-tests' definitions
of sizes, counts and bandwidths (``nccl_tests``). No I/O; imported by the rank side and the rules alike."""
