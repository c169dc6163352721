"""k3lab.widgets: explorers are built only when a front end is attached, never in a headless run."""
import pytest

from k3lab import widgets


@pytest.fixture
def calls():
    seen = []

    def draw(a: float = 1.0, n=4):
        seen.append((a, n))

    draw.seen = seen
    return draw


def test_headless_run_builds_no_widget_and_does_not_call_fn(calls, monkeypatch, capsys):
    monkeypatch.delenv(widgets.FORCE_ENV, raising=False)
    monkeypatch.delenv(widgets.SESSION_ENV, raising=False)
    assert not widgets.frontend_attached()
    assert widgets.explore(calls, a=(0.0, 2.0, 0.5)) is None
    assert calls.seen == []
    assert "K3LAB_WIDGETS=1" in capsys.readouterr().out


@pytest.mark.parametrize("env, attached", [({"JPY_SESSION_NAME": "/book/01_kda.ipynb"}, True),
                                           ({"JPY_SESSION_NAME": "/book/01_kda.ipynb", "K3LAB_WIDGETS": "0"}, False),
                                           ({"K3LAB_WIDGETS": "1"}, True)])
def test_frontend_detection(env, attached, monkeypatch):
    monkeypatch.delenv(widgets.FORCE_ENV, raising=False)
    monkeypatch.delenv(widgets.SESSION_ENV, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert widgets.frontend_attached() is attached


def test_attached_front_end_gets_an_interactive_explorer(calls, monkeypatch):
    ipywidgets = pytest.importorskip("ipywidgets")
    monkeypatch.setenv(widgets.FORCE_ENV, "1")
    explorer = widgets.explore(calls, a=(0.0, 2.0, 0.5), n=[1, 2, 4, 8])
    assert isinstance(explorer, ipywidgets.interactive)
    assert calls.seen == [(1.0, 4)], "interactive draws once with fn's defaults"
    explorer.close()


def test_bad_arguments_are_named(monkeypatch):
    monkeypatch.setenv(widgets.FORCE_ENV, "yes")
    with pytest.raises(ValueError, match=r"\$K3LAB_WIDGETS must be 0 or 1"):
        widgets.frontend_attached()
    with pytest.raises(TypeError, match="fn must be callable"):
        widgets.explore("plot_gates")
