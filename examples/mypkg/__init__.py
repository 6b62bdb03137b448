"""An installable package's evaluation entry point: distcheck run -m mypkg.evaluate."""
