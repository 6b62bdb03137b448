"""``python -m distcheck``: Ctrl-C is honoured before anything heavy loads (``distcheck.interrupt``)."""

from distcheck import interrupt

interrupt.install()

from distcheck.cli import main  # noqa: E402  (after the handler: the CLI's imports take a while)

if __name__ == "__main__":
    main()
