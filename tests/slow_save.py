"""`python tests/slow_save.py SECONDS ARGS...` runs `python -m dflash_lib ARGS...` with every checkpoint save
held for SECONDS at its most fragile point: every rank has written (and hashed) its files, and rank 0 has not yet
written the manifest nor renamed the temp folder into place. It prints PAUSING (with the step and the temp
folder) on stderr first, so that the kill -9 tests kill the run exactly there, in the middle of a save. Works
under torchrun too: `python -m torch.distributed.run ... tests/slow_save.py SECONDS train ...`."""

import sys
import time
from pathlib import Path

PAUSING = "slow save: pausing"  # what the line on stderr starts with


def main(delay_s: float, args: list[str]) -> int:
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the library of this checkout, as `-m` in the repo
    from dflash_lib.__main__ import main as command_line
    from dflash_lib.rundir.checkpoints import Manifest
    from dflash_lib.train import checkpoint

    commit = checkpoint._commit

    def slow_commit(tmp: Path, final: Path, manifest: Manifest) -> None:
        print(f"{PAUSING} {delay_s} s before committing the checkpoint of step {manifest.step} ({tmp.name})",
              file=sys.stderr, flush=True)
        time.sleep(delay_s)
        commit(tmp, final, manifest)

    checkpoint._commit = slow_commit
    return command_line(args)


if __name__ == "__main__":
    sys.exit(main(float(sys.argv[1]), sys.argv[2:]))
