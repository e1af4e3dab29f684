"""``python -m ktinject.calibrate``: the same as ``ktinject calibrate`` (``ktinject.cli.calibrate``)."""
if __name__ == "__main__":
    import sys

    from ktinject.cli.calibrate import main

    sys.exit(main())
