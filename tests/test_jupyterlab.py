"""JupyterLab as the README starts it (`jupyter lab --notebook-dir book`) pairs each notebook with its .py.

jupytext's server-side contents manager looks for its configuration from the notebook's folder up to
the server's root only, so the committed ``book/jupytext.toml`` is what makes saving in JupyterLab
rewrite the paired ``.py``. The test serves a copy of that configuration and a tiny chapter from
``tmp_path``, saves the notebook through the contents API and checks the ``.py``.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
JUPYTER = Path(sys.executable).parent / "jupyter"
TOKEN = "k3lab-test-token"

CHAPTER = '''# %% [markdown]
# # A tiny chapter

# %%
x = 1
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(method: str, url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Authorization": f"token {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read() or b"{}")


@pytest.fixture
def lab(tmp_path):
    """`jupyter lab --notebook-dir <tmp>/book` on a free port; yields (base url, book folder)."""
    if not JUPYTER.exists():
        pytest.skip(f"no jupyter next to {sys.executable}")
    book = tmp_path / "book"
    book.mkdir()
    shutil.copy2(ROOT / "book" / "jupytext.toml", book / "jupytext.toml")
    (book / "01_tiny.py").write_text(CHAPTER)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A tiny chapter"),
                                         nbformat.v4.new_code_cell("x = 1")])
    nbformat.write(nb, book / "01_tiny.ipynb")
    port = _free_port()
    # Runtime files, user config, user data and workspaces stay under tmp_path; the venv's system config (which
    # enables the jupytext server extension) is still read.
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_DATA_DIR": str(tmp_path / "data"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws")}
    cmd = [str(JUPYTER), "lab", "--notebook-dir", str(book), "--no-browser", f"--port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={TOKEN}", "--ServerApp.ip=127.0.0.1"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "lab.log", "wb")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 25
        while True:
            try:
                _request("GET", f"{url}/api/status")
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("jupyter lab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
                time.sleep(0.2)
        yield url, book
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


@pytest.mark.timeout(60)
def test_saving_in_jupyterlab_updates_the_paired_py(lab):
    url, book = lab
    model = _request("GET", f"{url}/api/contents/01_tiny.ipynb")
    model["content"]["cells"][1]["source"] = "x = 2  # edited in JupyterLab"
    _request("PUT", f"{url}/api/contents/01_tiny.ipynb",
             {"type": "notebook", "format": "json", "content": model["content"]})
    text = (book / "01_tiny.py").read_text()
    assert "x = 2  # edited in JupyterLab" in text, text
    assert "# %%" in text, "the .py must stay in py:percent"
    assert "edited in JupyterLab" in "".join(nbformat.read(book / "01_tiny.ipynb", as_version=4).cells[1].source)
