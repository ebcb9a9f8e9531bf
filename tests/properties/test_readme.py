"""The README's examples run as written, and its test command is the one CI runs.

Every ```python block of README.md and of the pages in docs/ is run in a fresh interpreter, in a temporary
directory, on the CPU platform. A block whose first line names ``torchrun
--nproc-per-node N`` runs under ``python -m torch.distributed.run`` with N processes over
gloo, as the README tells its reader to run it. A block may be skipped only by an
explicit, visible reason: a ``<!-- not run: reason -->`` comment on the line before it.
An example that uses the simulated device is skipped, with the probe's reason, on a torch
that cannot host it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
README_LIMIT = 16 * 1024
"""The README's size at most, in bytes: it is the task-first page; details go to docs/."""
CI_SCRIPT = REPO / ".ci" / "run"

_FENCE = re.compile(r"^```(?P<lang>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
_NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>[^>]*?)\s*-->\s*$")
_TORCHRUN = re.compile(r"^#.*\btorchrun\b.*--nproc-per-node[ =](?P<n>\d+)")
_USES_SIM = re.compile(r"simulated_backend|device=\"sim")
_USES_PORTABLE_MODE = re.compile(r"portable_random|set_portable_random")


def _blocks(lang: str) -> list[tuple[str, str, str]]:
    """``(file:line, body, reason it is not run or "")`` of every block fenced as ``lang`` in the README and
    the docs pages."""
    found = []
    for page in [README, *DOCS]:
        text = page.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            if match["lang"].strip() != lang:
                continue
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            skip = _NOT_RUN.search(before)
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(REPO)}:{line}", match["body"], skip["reason"] if skip else ""))
    return found


PYTHON_BLOCKS = _blocks("python")


def _env() -> dict[str, str]:
    """The environment a reader on a CPU machine has: the CPU platform, nothing forced on torch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYPERRNG_", "TORCHELASTIC_"))}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a test run under torchrun must not make the examples join its job
    env["HYPERRNG_PLATFORM"] = "cpu"
    return env


def test_the_readme_has_python_examples_and_runs_every_one() -> None:
    assert len(PYTHON_BLOCKS) >= 3, "the README lost its examples (or this test no longer finds them)"
    skipped = [(line, reason) for line, _, reason in PYTHON_BLOCKS if reason]
    assert not skipped, f"README examples that are not run (line, reason): {skipped}; make them runnable"


def test_exactly_one_example_is_the_end_to_end_job_under_torchrun() -> None:
    launched = [line for line, body, _ in PYTHON_BLOCKS if _TORCHRUN.match(body)]
    assert len(launched) == 1, f"expected one torchrun example, found them at lines {launched}"


@pytest.mark.parametrize(
    ("line", "body"),
    [
        pytest.param(
            line,
            body,
            id=line,
            marks=[pytest.mark.multiproc, pytest.mark.slow] if _TORCHRUN.match(body) else [],
        )
        for line, body, reason in PYTHON_BLOCKS
        if not reason
    ],
)
def test_a_readme_python_example_runs_as_written(line: str, body: str, tmp_path: Path) -> None:
    if _USES_SIM.search(body):
        from hyperrng.platforms.simulated import backend_conflict

        reason = backend_conflict()
        if reason is not None:
            pytest.skip(f"the example at {line} uses the simulated device, which this torch cannot host: {reason}")
    if _USES_PORTABLE_MODE.search(body):
        from hyperrng.platforms import _features

        if not _features.feature("portable-mode").available:
            pytest.skip(f"the example at {line} uses portable mode: {_features.feature('portable-mode').refusal()}")
    script = tmp_path / "example.py"
    script.write_text(body, encoding="utf-8")
    launch = _TORCHRUN.match(body)
    if launch:
        nproc = launch["n"]
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc]
    else:
        command = [sys.executable]
    done = subprocess.run([*command, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True)
    if launch and done.returncode != 0 and _only_torch_teardown_aborted(done, int(launch["n"])):
        pytest.xfail(
            f"every rank of the example at {line} finished, then a rank aborted (SIGABRT) while torch tore "
            "down its gloo process group at exit: a known torch teardown race, seen under heavy load"
        )
    assert done.returncode == 0, f"the example at {line} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"


_FINISHED = re.compile(r"^rank (\d+): resumed bit-identically$", re.MULTILINE)
_ABORTED = re.compile(r"exitcode\s*:\s*-6\b|Signal 6 \(SIGABRT\)")


def _only_torch_teardown_aborted(done: subprocess.CompletedProcess[str], nproc: int) -> bool:
    """Whether a failed torchrun of the example failed only after its last line ran on every rank.

    The example prints ``rank N: resumed bit-identically`` on every rank once its check has
    passed, then destroys the process group. Under heavy load a rank sometimes aborts after
    that, inside torch's gloo teardown at interpreter exit (worker threads still releasing
    tensors while the interpreter finalises). That is reported as such, not as the example
    failing; any other failure, or an abort before every rank finished, still fails the test.
    """
    finished = {int(rank) for rank in _FINISHED.findall(done.stdout)}
    return finished == set(range(nproc)) and _ABORTED.search(done.stderr) is not None


def _readme_test_command() -> str:
    commands = [
        line
        for _, body, _ in _blocks("bash")
        for line in body.splitlines()
        if "pytest" in line and not line.lstrip().startswith("#")
    ]
    assert len(commands) == 1, f"the README should give one test command in its quick start, found {commands}"
    return commands[0].strip()


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    ci_lines = [
        line.strip()
        for line in CI_SCRIPT.read_text(encoding="utf-8").splitlines()
        if "pytest" in line and not line.lstrip().startswith("#")
    ]
    assert ci_lines == [_readme_test_command()]


def test_the_readme_test_command_installs_the_test_extra_then_runs_pytest_quietly() -> None:
    assert _readme_test_command() == 'python -m pip install -e ".[test]" && python -m pytest -q -n auto'


@pytest.mark.parametrize(
    ("stdout", "stderr", "torch_teardown_only"),
    [
        ("rank 0: resumed bit-identically\nrank 1: resumed bit-identically\n", "exitcode  : -6 (pid: 7)", True),
        ("rank 1: resumed bit-identically\n", "exitcode  : -6 (pid: 7)", False),  # rank 0 died before its end
        ("rank 0: resumed bit-identically\nrank 1: resumed bit-identically\n", "exitcode  : 1 (pid: 7)", False),
        ("", "AssertionError\nexitcode  : 1 (pid: 7)", False),
    ],
)
def test_only_an_abort_after_every_rank_finished_counts_as_torchs_teardown(
    stdout: str, stderr: str, torch_teardown_only: bool
) -> None:
    done = subprocess.CompletedProcess(["torchrun"], 1, stdout, stderr)
    assert _only_torch_teardown_aborted(done, 2) is torch_teardown_only


def test_every_readme_section_the_code_points_to_exists() -> None:
    # A PlatformError once sent plug-in authors to the README section 'Plugging in a device',
    # which the README never had.
    headings = set(re.findall(r"^#+ (.+?)\s*$", README.read_text(), re.MULTILINE))
    sources = [*REPO.joinpath("hyperrng").rglob("*.py"), *REPO.joinpath("platforms").rglob("*.py")]
    named = {name for path in sources for name in re.findall(r"README, '([^']+)'", path.read_text())}
    assert named, "the code names no README section any more: drop this test"
    assert named <= headings, f"sections named in the code but missing from the README: {named - headings}"


GPU_SCRIPT = REPO / ".ci" / "gpu"


def test_the_gpu_command_runs_each_step_under_a_time_limit_and_logs_it() -> None:
    text = GPU_SCRIPT.read_text()
    assert os.access(GPU_SCRIPT, os.X_OK) and subprocess.run(["bash", "-n", str(GPU_SCRIPT)]).returncode == 0
    steps = re.findall(r"^(?:    )?step ([\w-]+) (\d+) (.*)$", text, re.MULTILINE)
    assert [name for name, _, _ in steps] == [
        "facts",
        "cuda-tests",
        "suite-on-cuda",
        "portable-demo-on-cuda",
        "bench-gpu",
    ]
    commands = {name: command for name, _, command in steps}
    assert "-m cuda" in commands["cuda-tests"]
    assert "HYPERRNG_PLATFORM=cuda" in commands["suite-on-cuda"] and "-n 14" in commands["suite-on-cuda"]
    assert commands["bench-gpu"].endswith("-m hyperrng bench --suite gpu")
    assert "timeout --kill-after" in text and "LOGS=${OUT:-" in text


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: run .ci/gpu itself")
def test_the_gpu_command_gives_the_facts_then_refuses_a_machine_without_a_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    out = subprocess.run([str(GPU_SCRIPT)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no CUDA device here: this command is for a machine with an NVIDIA GPU" in out.stdout
    facts = (tmp_path / "facts.log").read_text()
    assert f"torch {torch.__version__}" in facts and "chosen because:" in facts  # hyperrng info ran


def test_the_readme_fits_and_every_page_it_links_to_exists() -> None:
    text = README.read_text(encoding="utf-8")
    size = len(text.encode("utf-8"))
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move details to a page in docs/"
    linked = set(re.findall(r"\]\((docs/[^)#]+)", text))
    assert linked, "the README links to no page in docs/ any more"
    missing = sorted(p for p in linked if not (REPO / p).is_file())
    assert not missing, f"pages the README links to but the repository lacks: {missing}"
    unlinked = sorted(str(p.relative_to(REPO)) for p in DOCS if str(p.relative_to(REPO)) not in linked)
    assert not unlinked, f"pages in docs/ that the README does not link to: {unlinked}"
