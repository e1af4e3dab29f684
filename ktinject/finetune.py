"""``python -m ktinject.finetune``: the same as ``ktinject finetune`` (``ktinject.cli.finetune``)."""
if __name__ == "__main__":
    import sys

    from ktinject.cli.finetune import main

    sys.exit(main())
