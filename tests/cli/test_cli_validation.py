"""The command line checks every argument and output path before it starts work: each bad argument
exits 2 with one ``error:`` line (or argparse's usage error) naming the option, and no run function
is called (they are replaced by ones that raise). The known defects each have a case: ``report
--out`` to an unwritable path or an existing file, ``mismatch`` / ``cp-check`` refusing their output
path only after the run, ``cp-check --tokens -8`` tracebacks, ``--plant a:b:c`` not naming
``--plant``, zero / negative counts and a non-positive or NaN ``--entropy``."""

import os
import pathlib
import stat
import subprocess
import sys

import pytest
import torch.multiprocessing

import inductor_ext.__main__ as cli
from inductor_ext.cli_args import check_output_path

PARAM = "layers.1.attn_hc.scale"  # a parameter of the tiny model (cp-check --plant)


class WorkStarted(AssertionError):
    pass


@pytest.fixture
def no_work(monkeypatch):
    """Every entry into real work raises :class:`WorkStarted`."""
    def refuse(name):
        def run(*args, **kwargs):
            raise WorkStarted(name)
        return run

    for name in ("run_report", "run_mismatch", "run_benches", "write_mismatch"):
        monkeypatch.setattr(cli, name, refuse(name))
    monkeypatch.setattr(torch.multiprocessing, "start_processes", refuse("cp-check processes"))


@pytest.fixture
def paths(tmp_path):
    """Named bad output paths (``{FILE}``, ...) substituted into the argument lists."""
    file = tmp_path / "a_file"
    file.write_text("x")
    clash = tmp_path / "clash"
    for name in ("report.json", "mismatch.json", "bench.md"):
        (clash / name).mkdir(parents=True)
    return {"{FILE}": str(file), "{UNDER_FILE}": str(file / "sub"), "{DIR}": str(tmp_path),
            "{CLASH}": str(clash), "{PROC}": "/proc/glm53-no-such-dir/out", "{OK}": str(tmp_path / "out")}


# (argv, the option the error names): each a bad argument
CASES = [
    # report
    (["report", "--out", "{FILE}"], "--out"),  # known defect: an existing regular file tracebacked
    (["report", "--out", "{PROC}"], "--out"),  # known defect: an unwritable path tracebacked
    (["report", "--out", "{UNDER_FILE}"], "--out"),
    (["report", "--out", "{CLASH}"], "--out"),  # report.json there is a directory
    (["report", "--out", ""], "--out"),
    (["report", "--tokens", "0"], "--tokens"),
    (["report", "--tokens", "129", "-5"], "--tokens"),
    (["report", "--tokens", "1.5"], "--tokens"),
    # bench
    (["bench", "kda", "--samples", "0"], "--samples"),
    (["bench", "kda", "--samples", "-3"], "--samples"),
    (["bench", "kda", "--tokens", "0"], "--tokens"),
    (["bench", "all", "--tokens", "x"], "--tokens"),
    (["bench", "kda", "--out", "{FILE}"], "--out"),
    (["bench", "layer", "--out", "{CLASH}"], "--out"),
    # mismatch
    (["mismatch", "--out", "{FILE}"], "--out"),  # known defect: refused only after the whole run
    (["mismatch", "--out", "{UNDER_FILE}"], "--out"),
    (["mismatch", "--out", "{PROC}"], "--out"),
    (["mismatch", "--out", "{CLASH}"], "--out"),
    (["mismatch", "--seqs", "0"], "--seqs"),
    (["mismatch", "--seqs", "-2"], "--seqs"),
    (["mismatch", "--new-tokens", "-1"], "--new-tokens"),
    (["mismatch", "--new-tokens", "0"], "--new-tokens"),
    (["mismatch", "--prompt-len", "0"], "--prompt-len"),
    (["mismatch", "--prompt-len", "2.5"], "--prompt-len"),
    (["mismatch", "--entropy", "0"], "--entropy"),
    (["mismatch", "--entropy", "-1"], "--entropy"),
    (["mismatch", "--entropy", "nan"], "--entropy"),
    (["mismatch", "--entropy", "inf"], "--entropy"),
    (["mismatch", "--entropy", "6"], "--entropy"),  # above ln(256): cannot be calibrated to
    (["mismatch", "--seed", "-1"], "--seed"),
    (["mismatch", "--seed", str(2**64)], "--seed"),
    (["mismatch", "--arms", "nope"], "--arms"),
    (["mismatch", "--preset", "h200_stack"], "--device"),  # on the CPU
    # cp-check
    (["cp-check", "--tokens", "-8"], "--tokens"),  # known defect: tracebacked
    (["cp-check", "--tokens", "-8", "--ranks", "1"], "--tokens"),
    (["cp-check", "--tokens", "0"], "--tokens"),
    (["cp-check", "--tokens", "12"], "--tokens"),  # not a multiple of 8·ranks
    (["cp-check", "--ranks", "0"], "--ranks"),
    (["cp-check", "--ranks", "-1"], "--ranks"),
    (["cp-check", "--plant", "a:b:c"], "--plant"),  # known defect: the error did not name --plant
    (["cp-check", "--plant", f"{PARAM}:0"], "--plant"),
    (["cp-check", "--plant", f"{PARAM}:0:nan"], "--plant"),
    (["cp-check", "--plant", f"{PARAM}:-1:2"], "--plant"),
    (["cp-check", "--plant", f"{PARAM}:0:2:fp16"], "--plant"),
    (["cp-check", "--plant", f"{PARAM}:2:2"], "--plant"),  # rank 2 of 2 ranks
    (["cp-check", "--plant", "no.such.param:0:2"], "--plant"),  # would plant nothing, silently
    (["cp-check", "--json", "{FILE}/x.json"], "--json"),  # known defect: refused only after the run
    (["cp-check", "--json", "{DIR}"], "--json"),  # a directory
    (["cp-check", "--json", "{PROC}.json"], "--json"),
    (["cp-check", "--json", ""], "--json"),
    (["cp-check", "--layout", "striped"], "--layout"),
]


def _argv(argv, paths):
    out = []
    for a in argv:
        for key, value in paths.items():
            a = a.replace(key, value)
        out.append(a)
    return out


def _exit_code_and_error(argv, capsys) -> tuple[int, list[str]]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("argv,option", CASES, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bad_argument_exits_2_naming_the_option_before_any_work(argv, option, paths, no_work, capsys):
    if "{PROC}" in " ".join(argv) and not pathlib.Path("/proc").is_dir():
        pytest.skip("needs /proc (a directory no one can write in)")
    code, err = _exit_code_and_error(_argv(argv, paths), capsys)
    assert code == 2, err
    assert err and not any("Traceback" in line for line in err), err
    if err[0].startswith("error: "):  # main's one line
        assert len(err) == 1 and option in err[0], err
    else:  # argparse: usage lines, then the error naming the option
        assert err[-1].split("error: ", 1)[1].startswith(f"argument {option}"), err


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes in a read-only directory")
@pytest.mark.parametrize("command", ["report", "mismatch", "bench"])
def test_read_only_directory_is_refused(command, tmp_path, no_work, capsys):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        code, err = _exit_code_and_error([command, *(["kda"] if command == "bench" else []), "--out",
                                          str(ro / "out")], capsys)
    finally:
        ro.chmod(stat.S_IRWXU)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --out"), err


@pytest.mark.parametrize("argv,work", [
    (["report", "--device", "cpu", "--out", "{OK}"], "run_report"),
    (["mismatch", "--out", "{OK}", "--seqs", "2"], "run_mismatch"),
    (["cp-check", "--json", "{OK}/cp.json", "--plant", f"{PARAM}:1:1.1:fp32"], "cp-check processes"),
])
def test_good_arguments_reach_the_work(argv, work, paths, no_work):
    """The control: with good arguments the stand-ins do raise, so the cases above stopped first."""
    with pytest.raises(WorkStarted, match=work):
        cli.main(_argv(argv, paths))
    assert not pathlib.Path(paths["{OK}"]).exists(), "the check must not create the output directory"


def test_output_path_check_leaves_nothing_behind(tmp_path):
    assert check_output_path(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b"
    assert check_output_path(tmp_path, "--out") == tmp_path
    assert check_output_path(tmp_path / "x.json", "--json", kind="file") == tmp_path / "x.json"
    assert list(tmp_path.iterdir()) == []


def test_entry_point_exits_2_without_a_traceback(tmp_path):
    """The known ``cp-check --tokens -8`` traceback, through ``python -m``."""
    result = subprocess.run([sys.executable, "-m", "inductor_ext", "cp-check", "--tokens", "-8", "--ranks", "1"],
                            capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --tokens: must be a positive int, got -8" in result.stderr
