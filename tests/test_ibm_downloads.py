"""``fabric-model run``'s line after a data failure (fabric_model/ibm/downloads.py), in process.

torchvision's PyPI wheels need the CUDA build of torch, so torchvision cannot be installed
beside the CPU torch the tests use; its two failure shapes are rebuilt here from what the
explanation relies on: a ``download`` frame holding ``self.raw_folder`` and ``filename``, and a
data set's ``__init__`` raising "Dataset not found" with ``self.root`` and ``base_folder``. Keras'
real ``get_file`` is exercised through ``fabric-model run`` in tests/test_ibm_scripts.py.
"""

from __future__ import annotations

import urllib.error
from pathlib import Path

from fabric_model.ibm.downloads import explain


class MnistShaped:
    mirrors = ["https://mirror.invalid/mnist/"]

    def __init__(self, root: Path, download: bool) -> None:
        self.root = str(root)
        if download:
            self.download()

    @property
    def raw_folder(self) -> str:
        return str(Path(self.root) / "MnistShaped" / "raw")

    def download(self) -> None:
        for filename in ("train-images-idx3-ubyte.gz",):
            for mirror in self.mirrors:
                url = f"{mirror}{filename}"
                try:
                    raise urllib.error.URLError(f"offline: {url}")
                except urllib.error.URLError:
                    continue
            else:
                raise RuntimeError(f"Error downloading {filename}")


class CifarShaped:
    base_folder = "cifar-10-batches-py"

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        raise RuntimeError("Dataset not found or corrupted. You can use download=True to download it")


def caught(make: object) -> BaseException:
    try:
        make()  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 (the error under test, whatever it is)
        return exc
    raise AssertionError("expected an error")


def test_a_download_that_failed_names_the_file_and_its_folder(tmp_path: Path) -> None:
    line = explain(caught(lambda: MnistShaped(tmp_path, download=True)))
    assert line is not None
    assert f"place the file at {tmp_path / 'MnistShaped' / 'raw' / 'train-images-idx3-ubyte.gz'}," in line
    assert "Error downloading train-images-idx3-ubyte.gz" in line and "DATA_DIR" in line


def test_a_data_set_with_no_files_names_the_folder_it_looked_in(tmp_path: Path) -> None:
    line = explain(caught(lambda: CifarShaped(tmp_path)))
    assert line is not None and f"CifarShaped found no data in {tmp_path / 'cifar-10-batches-py'}" in line


def test_other_errors_get_no_line() -> None:
    assert explain(caught(lambda: 1 / 0)) is None
    assert explain(caught(lambda: open("/nonexistent/x"))) is None  # noqa: SIM115
