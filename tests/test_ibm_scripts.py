"""``fabric-model run`` on the idioms of IBM's published EDT scripts (issue 30), each a small job
of our own in the shape of theirs, run unchanged in real processes.

- the sample's own ``edtcallback``/``elog``/``emetrics`` beside the script win over the runtime's,
  whatever the script does to ``sys.path``; ``fabric.zip`` holds what IBM's held;
- the UI-generated ``pth_parameter_mgr`` from ``--param``/``--params``, or a clear refusal;
- ``Callback.on_epoch_end(epoch, save_model)``: True where the model is written;
- a failed data download names the file and where it goes (tests/test_ibm_downloads.py: torchvision's shapes);
- a TensorFlow script gets Keras 2 (``tf.keras`` is tf-keras) unless ``--keras3``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import textwrap
import zipfile
from pathlib import Path

import pytest

from .test_ibm_runtime import check_finished, fabric_run, only_run_dir, result, write_script

pytestmark = pytest.mark.processes


def need(module: str) -> None:
    # find_spec, not importorskip: importing TensorFlow here would change this process's os.environ.
    if importlib.util.find_spec(module) is None:
        assert not os.environ.get("FABRIC_MODEL_TEST_ALL_EXTRAS"), f"{module} is not installed"
        pytest.skip(f"{module} is not installed")


# -- 1. the sample's own modules win ------------------------------------------------------------

OWN_EDTCALLBACK = """
import json, os, sys
path = os.path.join(os.getenv("FABRIC_HOME"), "libs", "fabric.zip")
print("> own edtcallback loaded, fabric from %s" % path)
sys.path.insert(0, path)   # as IBM's HPO sample does, before its imports
from callbacks import LoggerCallback
from emetrics import EMetrics
from elog import ELog

class EDTLoggerCallback(LoggerCallback):
    def __init__(self):
        self.gs = 0
        self.history = []

    def log_train_metrics(self, loss, acc, completed_batch, worker=0):
        acc = acc / 100.0
        self.gs += 1
        with EMetrics.open() as em:
            em.record(EMetrics.TEST_GROUP, completed_batch, {"loss": loss, "accuracy": acc})
        with ELog.open() as log:
            log.recordTrain("Train", completed_batch, self.gs, loss, acc, worker)
        self.history.append({"steps": self.gs, "loss": float(loss), "accuracy": float(acc)})

    def log_test_metrics(self, loss, acc, completed_batch, worker=0):
        with ELog.open() as log:
            log.recordTest("Test", loss, acc / 100.0, worker)

    def on_train_end(self):   # the HPO tutorial's: the metric an HPO run reads
        with open(os.path.join(os.environ["RESULT_DIR"], "val_dict_list.json"), "w") as f:
            json.dump(self.history, f)
"""

OWN_ELOG = """
import sys
class ELog:   # the samples' elog writes to stdout
    @staticmethod
    def open(subId=None):
        return ELog()
    def recordTrain(self, title, iteration, global_steps, loss, accuracy, worker):
        print("OWN-ELOG %s step %d loss %.4f acc %.4f" % (title, global_steps, float(loss), float(accuracy)))
        sys.stdout.flush()
    def recordTest(self, title, loss, accuracy, worker):
        print("OWN-ELOG %s loss %.4f" % (title, float(loss)))
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        pass
"""

OWN_EMETRICS = """
import json, os
class EMetrics:   # a sample's own copy: one line per record, its own file name
    TEST_GROUP, TRAIN_GROUP = "test", "train"
    @staticmethod
    def open(subId=None):
        return EMetrics()
    def record(self, group, iteration, values):
        with open(os.path.join(os.environ["LOG_DIR"], "own-emetrics.txt"), "a") as f:
            f.write(json.dumps({"group": group, "iteration": iteration}) + "\\n")
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        pass
"""

OWN_MODULES_SCRIPT = """
import argparse
sys.path.insert(0, os.path.join(os.getenv("FABRIC_HOME"), "libs", "fabric.zip"))  # before, as the samples do
from fabric_model import FabricModel
from edtcallback import EDTLoggerCallback

parser = argparse.ArgumentParser()
parser.add_argument("--numWorker", type=int, default=16)
args, _ = parser.parse_known_args()
model = make_model()
before = full_loss(model)
FabricModel(model, get_datasets, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.2),
            driver_logger=EDTLoggerCallback()).train(2, 16, args.numWorker)
save_result(before=before, after=full_loss(model))
"""


def test_the_sample_s_own_edtcallback_elog_and_emetrics_win_over_the_runtime_s(tmp_path: Path) -> None:
    (tmp_path / "edtcallback.py").write_text(OWN_EDTCALLBACK)
    (tmp_path / "elog.py").write_text(OWN_ELOG)
    (tmp_path / "emetrics.py").write_text(OWN_EMETRICS)
    script = write_script(tmp_path, OWN_MODULES_SCRIPT)
    proc = fabric_run(script, "--numWorker", "2", cwd=tmp_path)
    check_finished(proc)
    run_dir = only_run_dir(tmp_path)
    res = result(run_dir)
    assert res["after"] < res["before"]
    assert proc.stdout.count("> own edtcallback loaded") == 1  # its import-time print, in the driver
    assert "OWN-ELOG Train step 1" in proc.stdout and "OWN-ELOG Test" in proc.stdout
    assert not (run_dir / "logs" / "elog.txt").exists()  # the runtime's elog never ran
    assert not (run_dir / "logs" / "evaluation-metrics.txt").exists()  # nor its emetrics
    own = [json.loads(line) for line in (run_dir / "logs" / "own-emetrics.txt").read_text().splitlines()]
    assert own and {r["group"] for r in own} == {"test"}  # the sample records train steps in TEST_GROUP
    history = json.loads((run_dir / "val_dict_list.json").read_text())  # written by its on_train_end
    assert history[0]["steps"] == 1 and history[-1]["loss"] < history[0]["loss"]
    assert all(0.0 <= h["accuracy"] <= 1.0 for h in history) and max(h["accuracy"] for h in history) > 0.1
    with zipfile.ZipFile(Path(res["env"]["FABRIC_HOME"]) / "libs" / "fabric.zip") as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
    assert tops == {"callbacks.py", "emetrics.py", "pyedt"}  # what IBM's runtime provided, no more


FALLBACK_SCRIPT = """
from edtcallback import EDTLoggerCallback   # no file of the sample's: the runtime's own
import elog
from fabric_model import FabricModel

model = make_model()
FabricModel(model, get_datasets, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.2),
            driver_logger=EDTLoggerCallback()).train(1, 16, 1)
save_result(elog=elog.__file__)
"""


def test_without_files_of_its_own_a_script_gets_the_runtime_s_edtcallback_and_elog(tmp_path: Path) -> None:
    script = write_script(tmp_path, FALLBACK_SCRIPT)
    check_finished(fabric_run(script, cwd=tmp_path))
    run_dir = only_run_dir(tmp_path)
    assert "Train," in (run_dir / "logs" / "elog.txt").read_text()
    assert "fabric.zip" not in result(run_dir)["elog"]


# -- 4. pth_parameter_mgr ------------------------------------------------------------------------

UI_SCRIPT = """
import argparse

def getDatasets():
    return get_datasets()

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_dir", type=str, default="")
    args, unknown = parser.parse_known_args()
    sys.path.insert(0, args.train_dir + "/../")
    import pth_parameter_mgr
    from fabric_model import FabricModel
    model = make_model()
    before = full_loss(model)
    optimizer = pth_parameter_mgr.getOptimizer(model)
    scheduler = pth_parameter_mgr.getLearningRate(optimizer)
    epochs = pth_parameter_mgr.getEpoch()
    result = FabricModel(model, getDatasets, F.cross_entropy, optimizer).train(
        epochs, pth_parameter_mgr.getTrainBatchSize(), 2)
    save_result(before=before, after=full_loss(model), epochs=len(result.history),
                optimizer=type(optimizer).__name__, lr=optimizer.param_groups[0]["lr"],
                momentum=optimizer.param_groups[0].get("momentum"), scheduler=type(scheduler).__name__,
                train_data=pth_parameter_mgr.getTrainData(False), test_batch=pth_parameter_mgr.getTestBatchSize(),
                module=pth_parameter_mgr.__file__)

if __name__ == "__main__":
    main()
"""


def test_pth_parameter_mgr_comes_from_the_values_given_to_run(tmp_path: Path) -> None:
    script = write_script(tmp_path, UI_SCRIPT, name="elastic-main.py")
    params = tmp_path / "ui.json"
    params.write_text(json.dumps({"optimizer": "sgd", "learning_rate": 0.2, "momentum": 0.5, "lr_policy": "step"}))
    options = (
        "--params",
        str(params),
        "--param",
        "epochs=2",
        "--param",
        "train_batch_size=16",
        "--param",
        "step_size=1",
    )
    proc = fabric_run(script, "--train_dir", str(tmp_path / "out"), cwd=tmp_path, options=options)
    check_finished(proc)
    res = result(only_run_dir(tmp_path))
    assert res["after"] < res["before"] and res["epochs"] == 2
    assert (res["optimizer"], res["momentum"], res["scheduler"]) == ("SGD", 0.5, "StepLR")
    assert res["lr"] == pytest.approx(0.2)
    assert res["train_data"] == str(tmp_path.resolve()) and res["test_batch"] == 16  # DATA_DIR; the train batch


def test_pth_parameter_mgr_without_values_fails_saying_what_to_pass(tmp_path: Path) -> None:
    script = write_script(tmp_path, UI_SCRIPT, name="elastic-main.py")
    proc = fabric_run(script, cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "No module named 'pth_parameter_mgr'" in last and "--param epochs=" in last and "learning_rate" in last
    bad = fabric_run(script, cwd=tmp_path, options=("--param", "optimizer=lbfgs"))
    assert bad.returncode == 2 and "optimizer" in bad.stderr and "'lbfgs'" in bad.stderr and "adam" in bad.stderr
    assert not list((tmp_path / "fabric_runs").glob("*/logs/worker-*.log"))  # refused before any worker


def test_a_pth_parameter_mgr_of_the_user_s_wins(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    (model_dir / "out").mkdir(parents=True)
    (model_dir / "pth_parameter_mgr.py").write_text(
        textwrap.dedent(
            """
            import torch
            def getOptimizer(model): return torch.optim.Adam(model.parameters(), lr=0.05)
            def getLearningRate(optimizer): return torch.optim.lr_scheduler.StepLR(optimizer, 1)
            def getEpoch(): return 1
            def getTrainBatchSize(): return 16
            def getTestBatchSize(): return 16
            def getTrainData(full_list): return "mine"
            """
        )
    )
    script = write_script(model_dir, UI_SCRIPT, name="elastic-main.py")
    check_finished(fabric_run(script, "--train_dir", str(model_dir / "out"), cwd=tmp_path))
    res = result(only_run_dir(tmp_path))
    assert (res["optimizer"], res["epochs"], res["train_data"]) == ("Adam", 1, "mine")


# -- 6. data the scripts download ----------------------------------------------------------------

OFFLINE = """
import urllib.error, urllib.request
def offline(*args, **kwargs):
    raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
urllib.request.urlopen = offline   # this machine, offline
"""

KERAS_DOWNLOAD = (
    OFFLINE
    + """
import tensorflow as tf
tf.keras.datasets.mnist.load_data(path=os.path.join(os.environ["DATA_DIR"], "mnist.npz"))
"""
)


def test_a_failed_keras_download_names_the_file(tmp_path: Path) -> None:
    need("tensorflow")
    need("tf_keras")
    proc = fabric_run(write_script(tmp_path, KERAS_DOWNLOAD, name="k.py"), cwd=tmp_path)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert "mnist.npz" in last and f"place the file at {tmp_path.resolve() / 'mnist.npz'}," in last, last


# -- 3. Keras 2 for TensorFlow scripts -----------------------------------------------------------

KERAS2_SCRIPT = """
import tensorflow as tf
opt = tf.keras.optimizers.Adam(lr=0.01)   # Keras 2 only
from tensorflow.keras.optimizers.legacy import SGD
print("KERAS", type(opt).__module__.split(".")[0], type(SGD(0.1)).__name__, round(float(opt.learning_rate), 6))
"""


def test_a_tensorflow_script_gets_keras_2_unless_keras3_is_asked(tmp_path: Path) -> None:
    need("tensorflow")
    need("tf_keras")
    script = tmp_path / "k.py"
    script.write_text(textwrap.dedent(KERAS2_SCRIPT))
    default = fabric_run(script, cwd=tmp_path, unset=("TF_USE_LEGACY_KERAS",))
    check_finished(default)
    assert "KERAS tf_keras SGD 0.01" in default.stdout
    assert default.stderr.count("tf.keras is Keras 2") == 1
    keras3 = fabric_run(script, cwd=tmp_path, options=("--keras3",), unset=("TF_USE_LEGACY_KERAS",))
    assert keras3.returncode == 1 and "lr" in keras3.stderr and "tf.keras is Keras 2" not in keras3.stderr


# -- 5. on_epoch_end(epoch, save_model) -----------------------------------------------------------

SAVE_MODEL_SCRIPT = """
from callbacks import Callback
from fabric_model import FabricModel

class ExportAtTheEnd(Callback):   # IBM's EDTTrainCallback exports ONNX when save_model is True
    def on_epoch_end(self, epoch, save_model=False):
        with open(os.path.join(os.environ["RESULT_DIR"], "saves-%d.jsonl" % os.getpid()), "a") as f:
            f.write(json.dumps([epoch, save_model, self.params["epochs"]]) + "\\n")
        if epoch == self.params["epochs"] - 1 and save_model:
            path = os.path.join(os.environ["RESULT_DIR"], "m%d.onnx" % os.getpid())
            torch.onnx.export(self.model, torch.randn(1, 8), path, dynamo=False)

model = make_model()
FabricModel(model, get_datasets, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.2),
            user_callback=[ExportAtTheEnd()]).train(3, 16, 2, checkpoint_freq=2)
"""


def test_on_epoch_end_gets_save_model_true_where_the_model_is_written(tmp_path: Path) -> None:
    need("onnx")
    check_finished(fabric_run(write_script(tmp_path, SAVE_MODEL_SCRIPT), cwd=tmp_path))
    run_dir = only_run_dir(tmp_path)
    calls = [[json.loads(line) for line in f.read_text().splitlines()] for f in run_dir.glob("saves-*.jsonl")]
    assert len(calls) == 2  # callbacks run in every worker; one of them is told to save, where the model is written
    assert sorted(calls) == [[[0, False, 3], [1, False, 3], [2, False, 3]], [[0, False, 3], [1, True, 3], [2, True, 3]]]
    assert len(list(run_dir.glob("m*.onnx"))) == 1  # a checkpoint epoch (freq 2) and the last


# -- 3. IBM's TensorFlow 2.x shape, trained with Keras 2 --------------------------------------------

SAVE_RESULT = """import json, os


def save_result(**values):
    with open(os.path.join(os.environ["RESULT_DIR"], "result.json"), "w") as f:
        json.dump(values, f)
"""


TF2X_SCRIPT = """
import argparse
import numpy as np
import tensorflow as tf
from fabric_model import FabricModel
from edtcallback import EDTLoggerCallback

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--lr", type=float, default=0.01)
args = parser.parse_args()

rng = np.random.default_rng(0)
x = rng.normal(size=(256, 6, 6, 1)).astype("float32")
labels = (x.reshape(256, -1)[:, :18].sum(1) > x.reshape(256, -1)[:, 18:].sum(1)).astype("int64")
y = tf.keras.utils.to_categorical(labels, 2)

def get_dataset():
    gen = tf.keras.preprocessing.image.ImageDataGenerator()
    train, test = gen.flow(x[:192], y[:192], batch_size=args.batch_size), gen.flow(x[192:], y[192:], batch_size=16)
    return train, test

model = tf.keras.models.Sequential()
model.add(tf.keras.layers.Conv2D(4, kernel_size=(3, 3), activation="relu", input_shape=(6, 6, 1)))
model.add(tf.keras.layers.Dropout(0.25))
model.add(tf.keras.layers.Flatten())
model.add(tf.keras.layers.Dense(2, activation="softmax"))
before = float(tf.keras.losses.categorical_crossentropy(y, model(x)).numpy().mean())
m = FabricModel(model, get_dataset, loss_function="categorical_crossentropy",
                optimizer=tf.keras.optimizers.Adam(lr=args.lr), driver_logger=EDTLoggerCallback())
history = m.train(args.epochs, args.batch_size, 16).history
after = float(tf.keras.losses.categorical_crossentropy(y, model(x)).numpy().mean())
save_result(before=before, after=after, keras=type(model).__module__.split(".")[0], history=history)
"""


def test_ibm_s_tensorflow_2_script_shape_trains_with_keras_2(tmp_path: Path) -> None:
    need("tensorflow")
    need("tf_keras")
    script = tmp_path / "tf2x.py"
    script.write_text(SAVE_RESULT + textwrap.dedent(TF2X_SCRIPT))
    proc = fabric_run(
        script,
        "--batch-size",
        "16",
        "--epochs",
        "3",
        "--lr",
        "0.05",
        cwd=tmp_path,
        env={"FABRIC_MODEL_CPU_WORKERS": "2"},
        unset=("TF_USE_LEGACY_KERAS",),
    )
    check_finished(proc)
    run_dir = only_run_dir(tmp_path)
    res = result(run_dir)
    assert res["keras"] == "tf_keras" and res["after"] < res["before"]
    assert len(res["history"]) == 3 and "accuracy" in res["history"][-1]
    assert "Train," in (run_dir / "logs" / "elog.txt").read_text()


def test_the_script_sees_its_arguments_as_typed_and_its_traceback_as_python_shows_it(tmp_path: Path) -> None:
    (tmp_path / "rel.py").write_text(
        "import sys\nprint(sys.argv, __name__, __file__)\ndef f():\n    raise ValueError('from the script')\nf()\n"
    )
    proc = fabric_run(Path("rel.py"), "--numWorker", "2", cwd=tmp_path)
    assert proc.returncode == 1
    assert f"['rel.py', '--numWorker', '2'] __main__ {tmp_path.resolve() / 'rel.py'}" in proc.stdout
    frames = [line for line in proc.stderr.splitlines() if line.startswith('  File "')]
    assert frames and all(str(tmp_path.resolve() / "rel.py") in line for line in frames), proc.stderr


FAILING_EXPORT_SCRIPT = """
from callbacks import Callback
from fabric_model import FabricModel

class Export(Callback):
    def on_epoch_end(self, epoch, save_model=False):
        if save_model and epoch == self.params["epochs"] - 1:
            raise RuntimeError("export failed in the user's callback")

model = make_model()
FabricModel(model, get_datasets, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.2),
            user_callback=[Export()]).train(2, 16, 2)
"""


def run_logs_tail(folder: Path) -> str:
    """The end of each log of the run in ``folder``: what a failed assertion about its outcome needs."""
    logs = sorted(folder.glob("fabric_runs/*/logs/*.log"))
    return "".join(f"\n--- {log.name} ---\n{log.read_text()[-1500:]}" for log in logs)


def test_an_error_in_the_one_worker_told_to_save_fails_the_job(tmp_path: Path) -> None:
    """Only one worker runs the save branch, after its peers finished: its error is the job's, not a
    lost worker to go on without (on a CPU-only host, wmla-2.3.0's export on 'cuda' fails so)."""
    proc = fabric_run(write_script(tmp_path, FAILING_EXPORT_SCRIPT), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-2000:] + run_logs_tail(tmp_path)
    assert proc.stderr.count("RuntimeError: export failed in the user's callback") == 1, proc.stderr[-3000:]


SAVER_KILLED_SCRIPT = """
import signal
from callbacks import Callback
from fabric_model import FabricModel

class Export(Callback):
    def on_epoch_end(self, epoch, save_model=False):
        if not (save_model and epoch == self.params["epochs"] - 1):
            return
        try:  # the first worker told to save dies in its save branch, as a preempted host would
            fd = os.open(os.path.join(FOLDER, "first_saver"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            with open(os.path.join(FOLDER, "exported"), "a") as f:
                f.write(f"{os.getpid()}\\n")
        else:
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)  # (a disposition cannot change what SIGKILL does)

model = make_model()
FabricModel(model, get_datasets, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.2),
            user_callback=[Export()]).train(2, 16, 2)
"""


def test_the_worker_killed_in_the_save_branch_at_the_end_leaves_it_to_a_survivor(tmp_path: Path) -> None:
    """Its peers finished and nothing would redo that epoch's end: the member asked for the final
    state runs the save branch (IBM's export) before handing it over, and the job ends well."""
    script = SAVER_KILLED_SCRIPT.replace("FOLDER", repr(str(tmp_path)))
    proc = fabric_run(write_script(tmp_path, script), cwd=tmp_path)
    check_finished(proc)
    first = int((tmp_path / "first_saver").read_text())
    exported = (tmp_path / "exported").read_text().split()
    assert len(exported) == 1 and int(exported[0]) != first, (first, exported)
    assert (only_run_dir(tmp_path) / "model" / "model.pt").is_file()
