"""The command line answers every mistake with one line and an exit status, never a traceback."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import hyperrng.platforms as platforms
import hyperrng.platforms.registry as registry
import pytest

import hyperrng
from hyperrng import cli
from hyperrng.cli.launch import run_ranks
from hyperrng.errors import HyperRNGError, PlatformError, RankFailure

REPO = Path(__file__).resolve().parents[2]


def _hyperrng(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != platforms.ENV_VAR}
    full_env = {**base, "PYTHONPATH": os.pathsep.join([str(REPO), env.pop("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-m", "hyperrng", *args], capture_output=True, text=True,
                          env=full_env, timeout=600, cwd=REPO)  # fmt: skip


def _one_error_line(out: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in out.stdout + out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    return lines[0]


def test_version_names_hyperrng_and_torch() -> None:
    out = _hyperrng("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"hyperrng {hyperrng.__version__} (torch ")


_UNSELECTABLE = [
    ("bogus", "error: unknown platform 'bogus'; known platforms: cpu, cuda, npu, sim"),
    ("no_such_module_xyz:Factory", "module 'no_such_module_xyz' failed to import"),
    ("npu", "error: platform 'npu' is not available: torch_npu is not installed"),
]


@pytest.mark.parametrize(("value", "fragment"), _UNSELECTABLE)
def test_info_with_a_platform_that_cannot_be_selected_reports_every_probe_then_fails_with_status_2(
    value: str, fragment: str
) -> None:
    out = _hyperrng("info", HYPERRNG_PLATFORM=value)
    assert out.returncode == 2
    line = _one_error_line(out)
    assert line.startswith("hyperrng info: error: ") and fragment in line
    assert "platform: none" in out.stdout and "  cpu      [builtin] available" in out.stdout


@pytest.mark.parametrize("command", [["demo"], ["bench", "--quick"]])
@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("bogus", "error: unknown platform 'bogus'; known platforms: cpu, cuda, npu, sim"),
        ("no_such_module_xyz:Factory", "module 'no_such_module_xyz' failed to import"),
        ("npu", "error: platform 'npu' is not available: torch_npu is not installed"),
    ],
)
def test_every_command_with_a_platform_that_cannot_be_selected_fails_in_one_line_with_status_2(
    command: list[str], value: str, fragment: str
) -> None:
    out = _hyperrng(*command, HYPERRNG_PLATFORM=value)
    assert out.returncode == 2
    line = _one_error_line(out)
    assert line.startswith(f"hyperrng {command[0]}: error: ") and fragment in line
    assert out.stdout == ""


def test_info_lines_report_a_platform_that_cannot_be_selected_instead_of_raising() -> None:
    code = "import hyperrng.cli as c; print('\\n'.join(c.info_lines()))"
    env = {**os.environ, "PYTHONPATH": str(REPO), platforms.ENV_VAR: "bogus"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "platform: none" in out.stdout and "error: unknown platform 'bogus'" in out.stdout
    assert "  cpu      [builtin] available" in out.stdout


@pytest.mark.parametrize("argv0", ["train.py", "/venv/bin/hyperrng", "-m"])
def test_a_library_import_with_a_bad_platform_succeeds_and_its_first_call_raises_the_error(argv0: str) -> None:
    # The same import serves a program and `python -m hyperrng`, and nothing but the command
    # line tells them apart before the package runs; so the import never fails, whatever the
    # command line says, and the first call that needs the platform raises the error.
    code = (
        f"import sys\nsys.argv = [{argv0!r}]\nimport hyperrng\n"
        "try:\n    hyperrng.set_random_seed(1)\n"
        "except hyperrng.PlatformError as exc:\n    print('raised:', exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), platforms.ENV_VAR: "bogus"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("raised: unknown platform 'bogus'; known platforms: cpu, cuda, npu, sim")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--seed", "-1"], "--seed: seed must be in [0, 2**64 - 1], got -1"),
        (["--seed", str(2**64)], "got 18446744073709551616"),
        (["--seed", "abc"], "argument --seed: invalid int value: 'abc'"),
        (["--world-size", "3"], "a world size of 3 cannot be arranged as dp x tp with tp=2"),
        (["--world-size", "1000"], "the demo starts at most 64"),
        (["--tp", "0"], "--tp must be a positive integer, got 0"),
        (["--steps", "2", "--save-step", "2"], "--save-step must lie in [1, --steps - 1]"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_every_demo_flag_is_checked_before_a_process_starts(args: list[str], fragment: str) -> None:
    out = _hyperrng("demo", *args)
    assert out.returncode == 2
    assert fragment in _one_error_line(out)
    assert out.stdout == ""


def test_a_missing_command_is_one_line() -> None:
    out = _hyperrng()
    assert out.returncode == 2
    assert "the following arguments are required: command" in _one_error_line(out)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["demo", "--nope"], "unrecognized arguments: --nope (see hyperrng demo --help)"),
        (["demo", "--seed", "abc"], "argument --seed: invalid int value: 'abc'"),
        (["demo", "--world-size", "1000"], "the demo starts at most 64"),
        (["bench", "--nope"], "unrecognized arguments: --nope (see hyperrng bench --help)"),
        (["bench", "--suite"], "argument --suite: expected one argument"),
        (["bench", "--quick", "--suite", "nonexistent"], "unknown benchmark suite(s) ['nonexistent']; choose from"),
        (["info", "--nope"], "unrecognized arguments: --nope (see hyperrng info --help)"),
    ],
)
def test_a_subcommand_error_is_one_line_naming_the_subcommand(args: list[str], fragment: str) -> None:
    out = _hyperrng(*args)
    assert out.returncode == 2
    line = _one_error_line(out)
    assert line.startswith(f"hyperrng {args[0]}: error: ") and fragment in line
    assert out.stdout == ""


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--nope", "demo"], "unrecognized arguments: --nope (see hyperrng --help)"),
        (["demoo"], "invalid choice: 'demoo'"),
    ],
)
def test_an_error_before_the_subcommand_names_hyperrng(args: list[str], fragment: str) -> None:
    out = _hyperrng(*args)
    assert out.returncode == 2
    line = _one_error_line(out)
    assert line.startswith("hyperrng: error: ") and fragment in line


def test_every_subcommand_error_is_prefixed_with_the_subcommand_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--quick", "--suite", "nonexistent"]) == 2
    assert capsys.readouterr().err.startswith("hyperrng bench: error: unknown benchmark suite(s) ['nonexistent']")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", "--nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("hyperrng demo: error: unrecognized arguments: --nope") and err.count("\n") == 1


def test_bench_help_lists_every_suite_name() -> None:
    from hyperrng.cli.bench import SUITES

    out = _hyperrng("bench", "--help")
    assert out.returncode == 0 and out.stderr == ""
    text = " ".join(out.stdout.split())  # argparse wraps the help
    assert "--suite NAME" in text
    assert f"one of: {', '.join(SUITES)}" in text


def test_demo_help_gives_every_default_and_the_process_limit() -> None:
    from hyperrng.cli.demo import DEFAULT_WORLD_SIZE, MAX_LOCAL_RANKS, PORTABLE_MAX_RANKS, DemoConfig

    out = _hyperrng("demo", "--help")
    assert out.returncode == 0 and out.stderr == ""
    text = " ".join(out.stdout.split())
    assert f"(default {DEFAULT_WORLD_SIZE}, at most {MAX_LOCAL_RANKS})" in text
    assert f"must divide the world size (default {DemoConfig.tp})" in text
    assert f"training steps; at least 2 (default {DemoConfig.steps})" in text
    assert f"in [1, --steps - 1] (default {DemoConfig.save_step})" in text
    assert f"in [0, 2**64 - 1] (default {DemoConfig.seed})" in text
    assert f"off by default; a world size of at most {PORTABLE_MAX_RANKS}" in text


def test_the_demo_defaults_are_the_config_defaults() -> None:
    from hyperrng.cli.demo import DemoConfig

    args = cli._parser().parse_args(["demo"])
    defaults = DemoConfig()
    assert (args.world_size, args.tp, args.steps, args.save_step, args.seed, args.portable) == (
        defaults.world_size,
        defaults.tp,
        defaults.steps,
        defaults.save_step,
        defaults.seed,
        defaults.portable,
    )


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_demo_accepts_the_largest_seed_the_library_accepts() -> None:
    out = _hyperrng("demo", "--seed", str(2**64 - 1), "--world-size", "2", "--steps", "2", "--save-step", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"base seed {2**64 - 1};" in out.stdout and out.stdout.count("[PASS]") == 5


# -- info lists every platform that can be named ---------------------------------------------


@pytest.mark.needs_sim
def test_info_lists_registered_and_entry_point_platforms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = "from hyperrng import platforms\nclass Listed(platforms.SimulatedPlatform):\n    name = 'listed'\n"
    (tmp_path / "plug_listed.py").write_text(source + "    def probe(self):\n        return 'no board'\n")
    info = tmp_path / "plug_listed-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plug_listed\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{platforms.ENTRY_POINT_GROUP}]\nlisted = plug_listed:Listed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    platforms.register("mysim", platforms.SimulatedPlatform)
    lines = cli.info_lines()
    assert "  mysim    [registered] available" in lines
    assert "  listed   [plugin plug_listed:Listed] unavailable - no board" in lines


def test_info_reports_an_entry_point_that_fails_to_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "plug_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plug_broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{platforms.ENTRY_POINT_GROUP}]\nbroken = no_such_module_abc:Make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = next(line for line in cli.info_lines() if line.startswith("  broken"))
    assert "unavailable - failed to load: ModuleNotFoundError" in line


def test_info_wraps_a_long_reason_to_fit_100_columns_and_loses_no_word(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    reason = "the board's firmware " + " ".join(f"v{i}.0" for i in range(30)) + " is not supported"
    (tmp_path / "plug_wordy.py").write_text(f"raise ImportError({reason!r})\n")
    info = tmp_path / "plug_wordy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plug_wordy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{platforms.ENTRY_POINT_GROUP}]\nwordy = plug_wordy:Make\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100
    start = next(i for i, line in enumerate(lines) if line.startswith("  wordy"))
    continued = list(itertools.takewhile(lambda line: line.startswith(" " * 6), lines[start + 1 :]))
    assert continued, "the long line goes on, indented past its own indent"
    assert reason in " ".join(" ".join([lines[start], *continued]).split())


# -- the launcher's failures -------------------------------------------------------------------


def _exit_on_rank_one(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    if rank == 1:
        os._exit(7)
    dist.barrier()  # blocks on the dead peer until the launcher stops this rank
    return rank


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("bad shard on purpose")
    return rank


@pytest.mark.multiproc
def test_a_rank_that_dies_is_named_with_its_exit_code() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_exit_on_rank_one, 2)
    assert info.value.summary == "rank 1 died with exit code 7 without answering"
    assert isinstance(info.value, HyperRNGError) and isinstance(info.value, RuntimeError)


@pytest.mark.multiproc
def test_a_rank_that_raises_is_named_with_its_exception_and_its_traceback_kept() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_one, 2)
    assert info.value.summary == "rank 1 failed: ValueError: bad shard on purpose"
    assert "Traceback" in info.value.details and "_raise_on_rank_one" in info.value.details


def test_a_programmatic_platform_that_cannot_be_rebuilt_in_a_rank_is_refused_before_any_start() -> None:
    class Local(platforms.SimulatedPlatform):  # defined in a function: a child cannot import it
        name = "local"

    with platforms.use(Local()):
        with pytest.raises(PlatformError, match="'local' set programmatically cannot be rebuilt in the rank"):
            run_ranks(_raise_on_rank_one, 2)


# -- output a person can follow --------------------------------------------------------------------


def _env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k != platforms.ENV_VAR}
    return {**base, "PYTHONPATH": str(REPO), **env}


@pytest.mark.parametrize(
    ("args", "status"),
    # argparse prints help and version itself, and takes a failed write as done: status 0
    [(["info"], 141), (["--version"], 0), (["--help"], 0), (["demo", "--help"], 0)],
)
def test_output_into_a_pipe_whose_reader_has_gone_ends_quietly(args: list[str], status: int) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes anything: every write fails
    try:
        out = subprocess.run([sys.executable, "-m", "hyperrng", *args], stdout=write, stderr=subprocess.PIPE,
                             text=True, env=_env(), cwd=REPO, timeout=600)  # fmt: skip
    finally:
        os.close(write)
    assert (out.returncode, out.stderr) == (status, "")


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["bench", "--quick", "--suite", "streams"], id="bench"),
        pytest.param(
            ["demo", "--world-size", "2", "--steps", "2", "--save-step", "1"],
            id="demo",
            marks=[pytest.mark.slow, pytest.mark.multiproc],
        ),  # fmt: skip
    ],
)
def test_a_reader_that_leaves_after_the_first_line_ends_the_command_quietly(args: list[str]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "hyperrng", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    first = proc.stdout.readline()
    proc.stdout.close()  # as `| head -1` does: every line after the first goes to a closed pipe
    err = proc.stderr.read()
    assert first.startswith(f"hyperrng {args[0]}")
    assert (proc.wait(), err) == (141, "")


def _cpu_model() -> str:
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@pytest.mark.slow
def test_bench_says_where_it_runs_then_prints_each_suite_and_row_as_measured_within_100_columns() -> None:
    import datetime

    import torch

    days = {f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}"}
    proc = subprocess.Popen([sys.executable, "-m", "hyperrng", "bench", "--quick", "--suite", "platform",
                             "--suite", "streams"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=REPO)  # fmt: skip
    out, err = proc.communicate()
    days.add(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}")  # the run may cross midnight
    assert (proc.returncode, err) == (0, "")
    lines = out.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    head = " ".join(lines[:2])
    assert _cpu_model() in head and f"{torch.get_num_threads()} torch threads" in head
    assert f"torch {torch.__version__}" in head and any(day in head for day in days)
    platform_at = next(i for i, line in enumerate(lines) if line.startswith("[1/2] platform"))
    streams_at = next(i for i, line in enumerate(lines) if line.startswith("[2/2] streams"))
    rows = [i for i, line in enumerate(lines) if line[:3].strip().isdigit()]
    assert platform_at < rows[0] < streams_at < rows[-1]  # each suite's rows follow its progress line
    assert [int(lines[i][:3]) for i in rows] == list(range(1, len(rows) + 1))
    assert "import torch + hyperrng" in lines[rows[0]] and "late/early rounds" in out
    # the closing summary (wrapped to 100 columns when it lists missed targets) follows the last row
    assert any(line.startswith(f"{len(rows)} rows in ") for line in lines[rows[-1] + 1 :])


@pytest.mark.slow
def test_bench_markdown_puts_the_table_alone_on_stdout_and_the_progress_on_stderr() -> None:
    out = _hyperrng("bench", "--quick", "--suite", "streams", "--markdown")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("hyperrng bench --quick: ") and max(map(len, lines)) <= 100
    table = [line for line in lines if line.startswith("|")]
    assert table[0] == "|#|benchmark|vs|ratio (range)|target|" and len(table) >= 5
    assert "[1/1] streams" in out.stderr and "[1/1]" not in out.stdout


def test_info_says_whether_cpu_positions_are_seeded_from_all_64_bits() -> None:
    from hyperrng.cli import info_lines

    assert "cpu positions: MT19937 seeded from all 64 bits of a position's handle" in info_lines()


def test_info_says_what_computes_the_philox_words_of_small_host_draws() -> None:
    from hyperrng.cli import info_lines
    from hyperrng.philox import _torch

    lines = [line for line in info_lines() if line.startswith("philox words on the host: ")]
    assert len(lines) == 1 and lines[0].split(": ")[1].startswith(_torch.HOST_WORDS)


# -- help ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "description"),
    [
        (["--help"], "Random-number state across devices and ranks for PyTorch training"),
        (["demo", "--help"], "Train a tiny tensor-parallel model with dropout on --world-size processes"),
        (["info", "--help"], "Which platform runs and why, every probe's result"),
        (["bench", "--help"], "Benchmarks of the current platform, each a ratio against a baseline"),
    ],
    ids=["hyperrng", "demo", "info", "bench"],
)
def test_every_help_describes_the_command_and_how_the_platform_is_chosen(
    args: list[str], description: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert description in text
    assert f"{platforms.ENV_VAR}=cpu, cuda, npu, sim or package.module:Factory chooses it" in text
    if args[0] == "demo":
        assert f"{platforms.ENV_VAR}=sim runs the accelerator code paths" in text


def _help_sections(obj: object) -> dict[str, str]:
    import pydoc
    import re

    text = pydoc.render_doc(obj, renderer=pydoc.plaintext)
    parts = re.split(r"^([A-Z][A-Z ]+)$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_help_of_the_package_gives_an_overview_and_names_no_private_member() -> None:
    sections = _help_sections(hyperrng)
    overview = sections["DESCRIPTION"]
    for topic in ("Streams", "Seeding", "Sharded tensors", "Across ranks", "Recompute", "Portable mode", "Errors"):
        assert f"* {topic}" in overview.replace("**", ""), topic
    assert sections.get("SUBMODULES", "").split() == ["platforms"]
    names = " ".join(sections[s] for s in ("CLASSES", "FUNCTIONS", "DATA") if s in sections)
    assert not [n for n in re.findall(r"^    (\w+)", names, re.MULTILINE) if re.match(r"_(?!_)", n)]
