"""What distcheck ships for testing distributed code without the hardware it runs on (``emulated_nccl``)."""
