"""The test run's own rules (tests/conftest.py): one process runs the GPU tests, the ones that
measure in children first; the tests' caches are their own."""

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_cuda_tests_run_in_one_process_children_measuring_ones_first():
    res = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-n", "2", "-v", "-p", "no:cacheprovider",
                          "tests/test_ppo.py", "tests/test_validate_probe.py", "tests/test_memory.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    ran = re.findall(r"^\[(gw\d+)\] \[ *\d+%\] (?:PASSED|SKIPPED|FAILED|ERROR) (\S+)", res.stdout, re.M)
    assert len(ran) >= 9, res.stdout[-3000:]  # 3 headlines + 5 grid rows + the others
    assert len({worker for worker, _ in ran}) == 1, ran
    assert all(test.endswith("@cuda") for _, test in ran), ran
    children = [i for i, (_, test) in enumerate(ran) if "test_validate_probe.py" in test]
    assert children == list(range(len(children))), ran  # before any test that runs CUDA in-process


def test_the_tests_caches_are_not_the_users():
    home = os.environ["XDG_CACHE_HOME"]
    assert "cache_home" in home and not home.startswith(str(Path.home() / ".cache"))
    # torchvision's weights are looked for where they were, not in the tests' folder
    assert not os.environ["TORCH_HOME"].startswith(home) and torch.hub.get_dir().startswith(os.environ["TORCH_HOME"])
