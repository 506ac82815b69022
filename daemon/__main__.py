"""``python -m decentd``: the same as the ``decentd`` command."""

from decentd.service.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
