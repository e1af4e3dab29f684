"""``python -m ktinject.chat``: the same as ``ktinject chat`` (``ktinject.cli.chat``)."""
if __name__ == "__main__":
    import sys

    from ktinject.cli.chat import main

    sys.exit(main())
