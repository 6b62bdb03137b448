"""distcheck's pytest plugin (the ``pytest11`` entry point is ``distcheck.pytest.plugin``):
``plugin`` holds the hooks, ``plan`` which marked tests share a launch, ``runner`` the part
that runs them (it imports torch, so only once a marked test runs)."""
