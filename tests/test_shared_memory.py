"""engine.rollout.shared_memory: torch's shared-memory manager holds none of the job's descriptors."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.distributed import REPO_ROOT

# In a process of its own: the sharing strategy is process-wide.
PROBE = r"""
import json, os, subprocess, sys
import torch
from engine.rollout.shared_memory import use_file_system_sharing

read_end, write_end = os.pipe()
os.set_inheritable(write_end, True)  # as the agent's resource-tracker pipe is in a forked rank
ours = {os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2, write_end)}
use_file_system_sharing()
use_file_system_sharing()  # once per process
torch.ones(4).share_memory_()
children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split()
managers = [pid for pid in children if open(f"/proc/{pid}/cmdline").read().startswith("torch_shm_manager")]
held = {os.readlink(f"/proc/{managers[0]}/fd/{fd}") for fd in os.listdir(f"/proc/{managers[0]}/fd")}
print(json.dumps({"managers": len(managers), "held_of_ours": sorted(held & ours),
                  "stderr": os.readlink(f"/proc/{managers[0]}/fd/2"),
                  "strategy": torch.multiprocessing.get_sharing_strategy(),
                  "still_inheritable": os.get_inheritable(write_end), "stderr_back": os.readlink("/proc/self/fd/2")}))
"""


def test_the_manager_starts_detached_from_the_jobs_output():
    """torch's manager outlives its last client by 2 s: had it our stderr (the job's output pipe), a
    reader of that pipe would wait for it after the job ended."""
    result = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.splitlines()[-1])
    assert probe["managers"] == 1 and probe["strategy"] == "file_system"
    assert probe["held_of_ours"] == [] and probe["stderr"] == "/dev/null"
    assert probe["still_inheritable"] and probe["stderr_back"].startswith("pipe:")
