"""Run one command inside a cgroup v1 memory group and print its peak memory (root only).

    sudo python benchmarks/cgroup_peak.py NAME LIMIT COMMAND...
    sudo python benchmarks/cgroup_peak.py slimml-big 2500M slimml convert /tmp/decode/tinyllama -o OUT --json

Prints the command's exit status (-9: killed by the group's OOM killer), seconds, the group's
``memory.max_usage_in_bytes`` (page cache included, so it reaches the limit under pressure) and
the peaks of ``memory.stat``'s ``total_rss`` (anonymous memory), ``total_cache``, ``total_dirty``,
``total_writeback`` and ``total_mapped_file``, sampled every 0.2 s. The group is removed after.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

KEYS = ("rss", "cache", "dirty", "writeback", "mapped_file")


def main(name: str, limit: str, command: list[str]) -> int:
    group = f"/sys/fs/cgroup/memory/{name}"
    os.makedirs(group, exist_ok=True)
    with open(f"{group}/memory.limit_in_bytes", "w") as f:
        f.write(limit)
    with open(f"{group}/memory.max_usage_in_bytes", "w") as f:
        f.write("0")
    peak = dict.fromkeys(KEYS, 0)
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            try:
                stat = dict(line.split() for line in open(f"{group}/memory.stat"))
                for k in KEYS:
                    peak[k] = max(peak[k], int(stat.get(f"total_{k}", 0)))
            except (OSError, ValueError):
                pass
            time.sleep(0.2)

    def join_group() -> None:
        with open(f"{group}/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.time()
    rc = subprocess.Popen(command, preexec_fn=join_group).wait()
    done.set()
    sampler.join()
    usage = int(open(f"{group}/memory.max_usage_in_bytes").read())
    print(f"rc={rc} seconds={time.time() - t0:.1f} max_usage={usage / 1e9:.3f}GB "
          + " ".join(f"peak_{k}={v / 1e9:.3f}GB" for k, v in peak.items()), flush=True)
    try:
        os.rmdir(group)
    except OSError as e:
        print(f"could not remove {group}: {e}", file=sys.stderr)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
