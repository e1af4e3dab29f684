"""``python -m ktinject.info``: the same as ``ktinject info`` (``ktinject.cli.info``)."""
if __name__ == "__main__":
    import sys

    from ktinject.cli.info import main

    sys.exit(main())
