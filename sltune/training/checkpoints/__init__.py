"""Checkpoints a job can resume from exactly: a Hugging Face folder plus `training_state/`, complete or refused.

    DIR/                               what transformers loads (config.json, safetensors, the run's tokenizer files)
    DIR/training_state/trainer.pt      step, run id, data position, scheduler, loss scale, RNG, save dtype, world size
    DIR/training_state/optimizer-rank{r}-of-{W}.pt   each rank's optimizer state (its shard when sharded)
    DIR/training_state/optimizer-rank{r}-of-{W}/     ... under optimizer_offload disk: the files of the engine's
                                                     last committed step (hard links: no second copy), a
                                                     manifest, and the optimizer's counters (optimizer.pt)
    DIR/training_state/weights.safetensors           the weights as stepped (the float32 masters), when the
                                                     folder's weights are in another dtype
    DIR/training_state/manifest.json   written last: the step, the run, and every file of the checkpoint with its
                                       size and checksum (xxh3_64 from xxhash, else zlib's crc32; a file hard-linked
                                       from the disk tier by its size: its folder's own manifest sums its blocks)
    DIR/.sltune-lock                   held (flock) by the run saving into DIR; names its pid and host

One writer. A run with --save holds DIR/.sltune-lock (an exclusive flock, rank 0, for the whole run; the kernel
drops it when the process dies); a second run on the same folder is refused in one line naming the holder. Only
the holder finishes or removes what a dead run left (`recover`), so whatever it finds there is dead by
construction, on any host and in any PID namespace.

One unit. A checkpoint is written whole into a hidden sibling (`.sltune-ckpt-{pid}-checkpoint-{N}` beside
DIR/checkpoint-N, `DIR/.sltune-save-{pid}` for the final DIR), each file flushed, the manifest last; then made
visible: a checkpoint-N folder by one rename (atomic: a reader sees the old folder or the new one), the final DIR
by moving the files in one by one and `training_state/` (with the manifest) last. That last move is not atomic
for a raw reader of DIR (transformers' from_pretrained during the move can read new weights with an old config);
for sltune it is: a kill at any moment leaves the last checkpoint or the new one, because a unit whose manifest
was written is complete and the next run (`--resume`, `--save` or `--model` on DIR) finishes moving it in, while a
`--model DIR` that a live run is moving into is refused. Recovery finishes a unit only when it is newer than what
it would replace (by its manifest's save time, then step) and never over a checkpoint-N that verifies; anything
else a dead run left (older or unfinished units, tombstones, the temporary files of older versions) is removed. A
fresh run or --overwrite finishes no unit: it discards them (a fresh run without --overwrite is refused when one
is complete).

Verified. `latest` resumes the newest checkpoint whose manifest verifies: every listed file present with its size,
trainer.pt and every safetensors file naming the manifest's step and run, and every checksum, the disk tier's
hard-linked blocks read whole against their own manifest's (remembered by inode, mtime and size, so the engine
adopting them reads none again; bench/resume_verify.py: 1.5 s/GB from a cold page cache, 0.4 warm). One that does
not is skipped with a line naming the file, and refused when nothing older verifies. Under several ranks rank 0
picks and verifies the checkpoint and the others load the one it names (`agree`).

Deleted whole. A checkpoint is deleted by renaming it to a tombstone first, so no half-deleted folder is ever seen
under its name. `prune` counts the complete checkpoints of this run only, keeps the newest, and runs after the new
one is complete.

Ranks fail together. Each phase of a save (and the start-up cleanup, and rotation) ends with every rank gathering
every rank's error line (`together`), so a rank that fails does not leave the others waiting at a collective: all
raise the same line.

SLTUNE_CRASH_AT=point[@n] kills the process (SIGKILL) the n-th time it reaches a point of CRASH_POINTS: the tests
and bench/checkpoint_soak.py kill at each write and rename with it.

The package holds it by job: where the parts live (`layout`), the manifest (`manifest`), the ranks (`ranks`), the
lock (`lock`), saving (`save`), verifying (`verify`), finishing or removing what a dead run left and rotation
(`recover`), and resuming (`resume`); a training job reads them from here.
"""

from sltune.runtime.disk.durable import CRASH_ENV
from sltune.runtime.disk.manifest import hash_file
from sltune.training.checkpoints.layout import CRASH_POINTS, LOCK, MANIFEST, TRAINER, TRAINING_STATE, WEIGHTS
from sltune.training.checkpoints.lock import FolderBusy, FolderLock, hold
from sltune.training.checkpoints.manifest import HASH, Incomplete, record
from sltune.training.checkpoints.ranks import new_run_id, together
from sltune.training.checkpoints.recover import (check_model_folder, check_save_folder, discard, drop_resume_state,
                                                 prune, recover, remove_old_checkpoints)
from sltune.training.checkpoints.resume import agree, exact_weights, latest, restore
from sltune.training.checkpoints.save import save_checkpoint
from sltune.training.checkpoints.verify import verify

__all__ = ["CRASH_ENV", "CRASH_POINTS", "HASH", "LOCK", "MANIFEST", "TRAINER", "TRAINING_STATE", "WEIGHTS",
           "FolderBusy", "FolderLock", "Incomplete", "agree", "check_model_folder", "check_save_folder", "discard",
           "drop_resume_state", "exact_weights", "hash_file", "hold", "latest", "new_run_id", "prune", "record",
           "recover", "remove_old_checkpoints", "restore", "save_checkpoint", "together", "verify"]
