"""The warm process: local workers are its forks, keep what a fresh worker gets, and no process
outlives the job (the caller killed or interrupted: tests/test_failures.py)."""

from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch.nn.functional as F

from fabric_model import FabricModel
from fabric_model.launchers import warm_spare
from fabric_model.launchers.fork_safety import fork_blockers
from fabric_model.launchers.local import worker_environment
from fabric_model.launchers.warm_client import WarmProcess
from fabric_model.settings.registry import LAUNCHED, SECRET
from fabric_model.setup.config import threads_per_worker
from fabric_model.testing import FaultInjector

from .helpers import fresh_model_and_optimizer, make_data

pytestmark = pytest.mark.processes

LAUNCHED_ENV, SECRET_ENV = LAUNCHED.name, SECRET.name

DATA = make_data(128)
WARM = "fabric_model.launchers.warm"


class Inspect:
    """A worker logger that records, once per worker, what its process looks like."""

    def __init__(self, out: Path) -> None:
        self.out = str(out)

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        import torch

        path = Path(self.out) / f"{os.getpid()}.json"
        if path.exists():
            return
        print(f"worker output {os.getpid()}")  # must reach this worker's log file
        parent = psutil.Process(os.getppid())
        facts = {
            "parent": parent.cmdline(),
            "parent_pid": parent.pid,
            "grandparent_pid": parent.ppid(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "threads": torch.get_num_threads(),
            "launched": os.environ.get(LAUNCHED_ENV),
            "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
            "tensorflow": "tensorflow" in sys.modules,
            "package": sys.modules["fabric_model"].__file__,
        }
        path.write_text(json.dumps(facts))


class KillWarmProcess:
    """A driver logger that SIGKILLs the job's warm process at ``iteration``."""

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration

    def log_train_metrics(self, metrics, iteration, epoch, workers):
        if iteration == self.iteration and self.iteration > 0:
            self.iteration = 0  # once: after the roll back, iteration 3 comes again
            for child in psutil.Process().children():
                if child.children():  # the warm process, whose children are the workers
                    child.kill()


def shadowing_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Work in a folder holding another ``fabric_model``: workers must import the caller's."""
    shadow = tmp_path / "cwd" / "fabric_model"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the working directory shadowed the package')\n")
    monkeypatch.chdir(shadow.parent)


SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []


def test_workers_are_forks_of_the_warm_process_with_a_fresh_workers_environment(run_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FABRIC_MODEL_WARM_START", "fresh")  # a fork of the caller: see tests below
    monkeypatch.setenv("FABRIC_MODEL_SMALL_STEP_FLOPS", "0")  # the cores' share, whatever the step's size
    shadowing_package(monkeypatch, tmp_path)
    # An interactive caller (python -c, a notebook) imports from its working directory ("" on
    # sys.path, last here so the caller's fabric_model stays first): so must its workers.
    (tmp_path / "cwd" / "cwd_datasets.py").write_text(
        "from tests.helpers import make_data\n\ndef datasets():\n    return make_data(128), None\n"
    )
    monkeypatch.setattr(sys, "path", [*sys.path, ""])
    datasets = importlib.import_module("cwd_datasets").datasets
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, datasets, F.cross_entropy, opt, worker_logger_callback=Inspect(tmp_path))
    fm.train(1, 16, 2, run_dir=run_dir)
    facts = {int(p.stem): json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert len(facts) == 2
    for fact in facts.values():
        assert fact["parent"][1:] == [*SAFE_PATH, "-m", WARM, "torch"]
        assert fact["package"] == sys.modules["fabric_model"].__file__
        assert fact["threads"] == threads_per_worker(2)
        assert fact["omp"] == os.environ.get("OMP_NUM_THREADS", str(threads_per_worker(2)))
        assert fact["launched"] == "1" and fact["sigint_ignored"] and not fact["tensorflow"]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("worker-*.log"))
    assert all(f"worker output {pid}" in logs for pid in facts)


def test_a_killed_warm_process_takes_its_workers_and_fresh_ones_finish_the_job(run_dir, tmp_path, monkeypatch):
    shadowing_package(monkeypatch, tmp_path)
    (tmp_path / "facts").mkdir()
    paced = FaultInjector([], tmp_path, inner=Inspect(tmp_path / "facts"), step_delay=0.05)  # no fault, slower steps
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(
        model,
        lambda: (DATA, None),
        F.cross_entropy,
        opt,
        worker_logger_callback=paced,
        driver_logger_callback=KillWarmProcess(3),
    )
    result = fm.train(3, 16, 2, run_dir=run_dir)
    assert len(result.history) == 3 and len(set(result.replica_digests.values())) == 1
    facts = [json.loads(p.read_text()) for p in (tmp_path / "facts").glob("*.json")]
    assert any(f["grandparent_pid"] == os.getpid() for f in facts)  # the first workers, forked
    assert any(f["parent_pid"] == os.getpid() for f in facts)  # then fresh interpreters
    packages = {json.loads(p.read_text())["package"] for p in (tmp_path / "facts").glob("*.json")}
    assert packages == {sys.modules["fabric_model"].__file__}


@pytest.fixture
def warm(tmp_path):
    process = WarmProcess(worker_environment(1, "127.0.0.1"), "torch", tmp_path / "warm.log")
    yield process
    process.close()


def test_a_warm_process_still_importing_when_the_job_ends_is_ended_without_an_error(tmp_path, caplog):
    """A fresh warm interpreter may still be importing when a short job (a restarted driver's
    last epochs) ends: nothing of the job is in it, so it is ended at once, not waited for and
    reported as stuck."""
    (tmp_path / "sitecustomize.py").write_text("import time\ntime.sleep(120)\n")  # an import that takes long
    env = worker_environment(1, "127.0.0.1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH", "")]))
    process = WarmProcess(env, "torch", tmp_path / "warm.log")
    with caplog.at_level(logging.INFO, logger="fabric_model.launchers.warm_client"):
        process.close(timeout=60)
    assert process.process.poll() is not None and not process.ready
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def _env(secret: str = "00" * 32) -> dict[str, str]:
    return {**worker_environment(1, "127.0.0.1"), SECRET_ENV: secret, LAUNCHED_ENV: "1"}


def test_a_forked_workers_exit_code_output_and_kill_are_a_fresh_ones(warm, tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens there
    refused = warm.fork(0, ["worker", "--driver", f"127.0.0.1:{port}", "--worker-id", "0"], _env(), tmp_path / "w0.log")
    assert refused is not None and refused.wait(timeout=60) == 2
    assert "cannot join the driver" in (tmp_path / "w0.log").read_text()
    usage = warm.fork(3, ["worker"], _env(), tmp_path / "w3.log")  # no --driver: argparse's exit 2
    assert usage is not None and usage.wait(timeout=60) == 2
    assert "the driver's address is missing" in (tmp_path / "w3.log").read_text()
    with socket.socket() as silent:  # accepts, never answers the handshake: the worker blocks
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        stuck = warm.fork(1, ["worker", "--driver", address, "--worker-id", "1"], _env(), tmp_path / "w1.log")
        assert stuck is not None
        with pytest.raises(subprocess.TimeoutExpired):
            stuck.wait(timeout=1.0)
        stuck.kill()
        assert stuck.wait(timeout=10) == -signal.SIGKILL
        left = warm.fork(2, ["worker", "--driver", address, "--worker-id", "2"], _env(), tmp_path / "w2.log")
        assert left is not None
        deadline = time.monotonic() + 30
        while left.pid is None and time.monotonic() < deadline:
            time.sleep(0.05)
        warm.close()  # the warm process takes a worker still running along
        assert left.wait(timeout=10) == -signal.SIGKILL
        assert not psutil.pid_exists(left.pid) or psutil.Process(left.pid).status() == psutil.STATUS_ZOMBIE
    assert warm.fork(4, ["worker"], _env(), tmp_path / "w4.log") is None  # gone: the launcher starts a fresh one


def run_warm_job(tmp_path: Path, *flags: str, mode: str | None = None) -> tuple[dict, list[dict], Path]:
    """tests/warm_job.py in its own process: its record, its workers' and its run directory."""
    out, run = tmp_path / "out", tmp_path / "run"
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "FABRIC_MODEL_WARM_START"}
    env["FABRIC_MODEL_SMALL_STEP_FLOPS"] = "0"  # the workers take the cores' share, whatever the step's size
    if mode is not None:
        env["FABRIC_MODEL_WARM_START"] = mode
    done = subprocess.run(
        [sys.executable, "-m", "tests.warm_job", str(out), str(run), *flags],
        cwd=Path(__file__).resolve().parents[1],  # where tests.warm_job imports from, wherever pytest runs
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    workers = [json.loads(p.read_text()) for p in out.glob("worker-*.json")]
    return json.loads((out / "job.json").read_text()), workers, run


def test_a_caller_without_thread_pools_is_forked_into_the_warm_process_and_trains_as_a_fresh_one(tmp_path):
    job, workers, run = run_warm_job(tmp_path / "fork")  # the default
    assert len(job["warm"]) == 1 and job["warm"][0]["cmdline"] == job["cmdline"]  # a fork of the script
    assert len(workers) == 2
    for worker in workers:
        assert worker["parent"] == job["warm"][0]["pid"]
        # Nothing of what the script set up before FabricModel(...) reaches a worker.
        assert worker["package_level"] == logging.INFO and worker["root_handlers"] == ["StreamHandler"]
        assert worker["sigterm"] == "LeaveNotice" and worker["grad"] and not worker["caller_file_open"]
        assert worker["threads"] == threads_per_worker(2)
        assert worker["omp"] == os.environ.get("OMP_NUM_THREADS", str(threads_per_worker(2)))
    assert "inspected worker" in "".join(p.read_text() for p in (run / "logs").glob("worker-*.log"))
    assert "inspected worker" not in (tmp_path / "fork" / "out" / "caller.log").read_text()
    fresh, _, _ = run_warm_job(tmp_path / "fresh", mode="fresh")
    assert fresh["warm"][0]["cmdline"][-3:] == ["-m", WARM, "torch"]
    assert job["digests"] == fresh["digests"] and len(job["digests"]) == 1  # the same training, bit for bit


def test_a_caller_that_imported_datasets_is_forked_beside_jemallocs_background_thread(tmp_path):
    """``import datasets`` (pyarrow) starts jemalloc's background thread, which jemalloc stops and
    restarts around a fork itself: the caller is still forked (0.1 s, not a fresh interpreter's
    seconds), and the workers train."""
    job, workers, run = run_warm_job(tmp_path, "--datasets")
    assert "jemalloc_bg_thd" in job["threads"], job["threads"]  # the thread was there to be judged
    assert job["warm"][0]["cmdline"] == job["cmdline"]  # a fork of the script
    assert len(workers) == 2 and all(w["parent"] == job["warm"][0]["pid"] for w in workers)
    assert "local workers fork from the warm process: a fork of the caller" in (run / "logs" / "driver.log").read_text()


def test_a_caller_whose_openmp_threads_have_started_gets_a_fresh_warm_process(tmp_path):
    job, workers, _ = run_warm_job(tmp_path, "--forward")
    assert job["warm"][0]["cmdline"][-3:] == ["-m", WARM, "torch"]
    assert len(workers) == 2 and all(w["parent"] == job["warm"][0]["pid"] for w in workers)


def test_a_fork_in_which_openmp_would_hang_becomes_a_fresh_warm_process_in_place(tmp_path):
    # Forced to fork after OpenMP ran: the warm process's probe must catch the hang.
    job, workers, run = run_warm_job(tmp_path, "--forward", mode="fork-always")
    assert job["warm"][0]["cmdline"] == job["cmdline"]
    assert len(workers) == 2 and all(w["parent"] == job["warm"][0]["pid"] for w in workers)  # exec kept the pid
    assert "OpenMP hangs in a fork of the caller" in (run / "logs" / "warm.log").read_text()


def test_fork_blockers_name_what_makes_a_fork_unsafe():
    script = (
        "import threading, torch\n"
        "from fabric_model.launchers.fork_safety import fork_blockers\n"
        "print(fork_blockers())\n"
        # A parallel operation on two threads starts OpenMP's pool on any CPU (a small matmul may not).
        "torch.set_num_threads(2); torch.ones(1 << 22).add_(1.0); import time; time.sleep(0.5)\n"
        "print(fork_blockers())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    before, after = done.stdout.splitlines()
    assert before == "[]" and "OpenMP" in after
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert any("Python threads" in reason for reason in fork_blockers())
    finally:
        stop.set()
        thread.join()


def python_prints(script: str) -> str:
    """What a fresh interpreter running ``script`` prints (it must succeed). Its output is buffered
    as on any host (PYTHONUNBUFFERED is dropped): a script that ends with ``os._exit`` flushes first."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_openblas_threads_beyond_its_count_are_told_by_where_they_wait_and_do_not_block_a_fork():
    """OpenBLAS's pool threads wait on its own statics: they are known by that, not only by the
    count ``get_num_threads`` gives now, which a script (or threadpoolctl) may have lowered after
    the pool started. Counting alone found one thread too many on a 16-core GPU host."""
    script = (
        "import ctypes, os, numpy\n"
        "from fabric_model.launchers import fork_safety as fs\n"
        "paths = sorted({p for _, _, p in fs._mapped_libraries() if 'openblas' in os.path.basename(p).lower()})\n"
        "lib = ctypes.CDLL(paths[0])\n"
        "get = next(n for n in fs._OPENBLAS_THREADS if hasattr(lib, n))\n"
        "pool = len(os.listdir('/proc/self/task')) - 1\n"
        "getattr(lib, get.replace('_get_', '_set_'))(1)\n"
        "print(pool, fs._openblas_pool_threads(fs._mapped_libraries()), fs.fork_blockers())\n"
    )
    out = python_prints(script)
    pool, counted, blockers = out.split(maxsplit=2)
    if int(pool) == 0:
        pytest.skip("OpenBLAS started no pool thread on this host (one core)")
    assert int(counted) == 0 and blockers.strip() == "[]", out
    # A native thread of another library (here libc's pause) does not pass for one of OpenBLAS's,
    # though the pool's count has room for it: those it counts are known already.
    script = (
        "import ctypes, os, time, numpy\n"
        "from fabric_model.launchers import fork_safety as fs\n"
        "libc = ctypes.CDLL(None)\n"
        "tid = ctypes.c_ulong()\n"
        "libc.pthread_create(ctypes.byref(tid), None, ctypes.cast(libc.pause, ctypes.c_void_p), None)\n"
        "time.sleep(0.2)\n"
        "print(fs._openblas_pool_threads(fs._mapped_libraries()), fs.fork_blockers(), flush=True)\n"
        "os._exit(0)  # the pause thread never ends\n"
    )
    out = python_prints(script)
    counted, blockers = out.split(maxsplit=1)
    assert int(counted) >= 1 and "native threads" in blockers, out


def test_a_warm_process_no_job_takes_ends_with_its_fabric_model(monkeypatch):
    warm_spare.end()  # one an earlier test's job left would be this FabricModel's
    model, opt = fresh_model_and_optimizer()
    before = {p.pid for p in psutil.Process().children()}
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt)
    (warm,) = [p for p in psutil.Process().children() if p.pid not in before]
    del fm
    gc.collect()
    assert not warm.is_running()
    # A constructor that fails after the warm process started ends it too.
    with pytest.raises(TypeError, match="metrics"):
        FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, metrics=[42])
    assert not {p.pid for p in psutil.Process().children()} - before
    monkeypatch.setenv("FABRIC_MODEL_WARM_START", "sometimes")
    with pytest.raises(ValueError, match="FABRIC_MODEL_WARM_START.*'fork'.*'sometimes'"):
        FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt)


def test_a_warm_process_started_for_another_path_is_replaced_by_one_the_workers_can_use(run_dir, tmp_path, monkeypatch):
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (importlib.import_module("late_datasets").make(), None), F.cross_entropy, opt)
    # A module the script can import only from a folder added after FabricModel(...) was built.
    (tmp_path / "late").mkdir()
    (tmp_path / "late" / "late_datasets.py").write_text(
        "from tests.helpers import make_data\nmake = lambda: make_data(64)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "late"))
    result = fm.train(1, 16, 2, run_dir=run_dir)
    assert len(result.history) == 1


def _train_inspected(out: Path, run_dir: Path) -> None:
    out.mkdir()
    model, opt = fresh_model_and_optimizer()
    fm = FabricModel(model, lambda: (DATA, None), F.cross_entropy, opt, worker_logger_callback=Inspect(out))
    fm.train(1, 16, 2, run_dir=run_dir)


def _gone(pid: int, timeout: float) -> bool:
    """Whether ``pid`` ended and was reaped (not a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not psutil.pid_exists(pid)


def test_a_fresh_warm_process_is_kept_for_the_next_job_of_the_same_environment_then_ends_by_itself(
    tmp_path, monkeypatch
):
    """A notebook's (or a test runner's) second train() forks its workers from the warm process the
    first one started, which waited, idle and without a worker, in between; a job whose workers
    get another environment starts its own; a kept process ends by itself when none comes."""
    warm_spare.end()
    monkeypatch.setenv("FABRIC_MODEL_WARM_START", "fresh")
    monkeypatch.setenv("FABRIC_MODEL_WARM_KEEP", "60")
    _train_inspected(tmp_path / "one", tmp_path / "run-one")
    kept = warm_spare.kept_pid()
    assert kept is not None and psutil.Process(kept).children() == []
    _train_inspected(tmp_path / "two", tmp_path / "run-two")
    for name in ("one", "two"):
        facts = [json.loads(p.read_text()) for p in (tmp_path / name).glob("*.json")]
        assert len(facts) == 2 and {f["parent_pid"] for f in facts} == {kept}, name
    assert warm_spare.kept_pid() == kept
    notes = [json.loads((tmp_path / r / "run.json").read_text())["startup"]["notes"] for r in ("run-one", "run-two")]
    assert notes[0]["warm process"].startswith("a fresh interpreter")
    assert notes[1]["warm process"].startswith("kept from an earlier job")

    monkeypatch.setenv("FABRIC_MODEL_WARM_KEEP", "1")  # the workers' environment changes with it
    _train_inspected(tmp_path / "three", tmp_path / "run-three")
    assert _gone(kept, 10), "the kept process of another environment was not ended"
    facts = [json.loads(p.read_text()) for p in (tmp_path / "three").glob("*.json")]
    (third,) = {f["parent_pid"] for f in facts}
    assert third != kept and warm_spare.kept_pid() == third
    assert _gone(third, 30), "a kept process outlived its idle time (or was left a zombie)"
    assert warm_spare.kept_pid() is None

    monkeypatch.setenv("FABRIC_MODEL_WARM_KEEP", "0")
    _train_inspected(tmp_path / "four", tmp_path / "run-four")
    assert warm_spare.kept_pid() is None


@pytest.mark.parametrize("ending", ["exit", "SIGKILL"])
def test_a_kept_warm_process_ends_with_its_caller(tmp_path, ending):
    """Kept after the job, it ends when the script ends, and when the script is SIGKILLed."""
    script = (
        "import os, signal, sys, torch.nn.functional as F\n"
        "from fabric_model import FabricModel\n"
        "from fabric_model.launchers import warm_spare\n"
        "from tests.helpers import fresh_model_and_optimizer, make_data\n"
        "model, opt = fresh_model_and_optimizer()\n"
        "data = make_data(64)\n"
        "fm = FabricModel(model, lambda: (data, None), F.cross_entropy, opt)\n"
        f"fm.train(1, 16, 2, run_dir={str(tmp_path / 'run')!r})\n"
        "print('kept', warm_spare.kept_pid(), flush=True)\n"
        f"if {ending == 'SIGKILL'}:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "FABRIC_MODEL_WARM_START": "fresh", "FABRIC_MODEL_WARM_KEEP": "300"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == (-signal.SIGKILL if ending == "SIGKILL" else 0), done.stderr
    kept = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("kept ")]
    assert kept and kept[0] != "None", done.stdout + done.stderr
    assert _gone(int(kept[0]), 20), f"the kept warm process outlived its caller ({ending})"
