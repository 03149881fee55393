"""``python -m lit_amp_det``: see :mod:`lit_amp_det.cli`."""

from lit_amp_det.cli import main

if __name__ == "__main__":
    main()
