"""sltune.runtime.hostheap: what malloc keeps of freed blocks goes back to the system (glibc)."""

import subprocess
import sys
import textwrap

import pytest

from sltune.runtime import hostheap

CHILD = textwrap.dedent("""
    import torch
    from sltune.runtime.hostheap import release_freed

    def rss():
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))

    torch.ones(4 << 20)                 # a 16 MiB block, freed at once: glibc's mmap threshold rises above 8 MiB
    kept = [torch.ones(2 << 20) for _ in range(40)]     # 40 blocks of 8 MiB, now from malloc's heap
    pin = torch.ones(2 << 20)                            # one more above them: the heap's top stays in use
    del kept
    before = rss()
    release_freed()
    print(before, rss())
""")


@pytest.mark.skipif(hostheap.malloc_trim() is None or not sys.platform.startswith("linux"),
                    reason="malloc_trim is glibc's")
def test_freed_blocks_malloc_kept_go_back_to_the_system():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    before, after = map(int, out.split())
    # the 320 MiB freed were still resident (malloc keeps them); the trim hands nearly all of them back
    assert before - after > 250 << 20, (before >> 20, after >> 20)
