"""``python -m trtkv``: the ``trtkv`` command (how the launcher starts a tensor-parallel command's other ranks)."""
from trtkv.cli import main

if __name__ == "__main__":
    main()
