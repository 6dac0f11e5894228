"""The old spelling of ``python -m mpilossy.bench torch``: ``python -m
mpilossy.torch.bench drift|overlap [options]`` runs that command."""

import sys

if __name__ == "__main__":
    from mpilossy.bench.__main__ import main
    sys.exit(main(["torch", *sys.argv[1:]]))
