"""``python -m ktinject.eval``: the same as ``ktinject eval`` (``ktinject.cli.eval``)."""
if __name__ == "__main__":
    import sys

    from ktinject.cli.eval import main

    sys.exit(main())
