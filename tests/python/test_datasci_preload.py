"""The shipped python-datasci image preloads what a plotting cell imports.

A session that runs `import numpy, pandas, matplotlib; matplotlib.use('agg');
import matplotlib.pyplot as plt` cost 33 MB PSS instead of 18.5 because the
image preloaded numpy, pandas and matplotlib but not pyplot (and the backend
it draws with): every session imported and copied those itself. The image is
too large to build in CI (docs/images.md), so its definition's `preload` and
`env` are put on the host's root (Debian's same packages) under a name of this
test's, forked from a zygote as python-datasci is.

Checked: such a cell, and `import seaborn, scipy.stats` (the image ships
them), import nothing of the data stack in a forked session
(everything came from the zygote), and preloading pyplot in the zygote keeps
the inline backend's integration: a figure still shows as image/png. And
the shipped `host` image, whose zygote warms the same stack without binding
it (`warm_imports`), keeps figures inline too.
"""
import json
import os
import shutil

import pytest

import server_helpers as sh

IMAGE = "datasci-preload-test"
DATASCI = os.path.join(sh.SOURCE_DIR, "images", "python-datasci", "image.json")
PLOTTING_CELL = ("import numpy, pandas, matplotlib\nmatplotlib.use('agg')\n"
                 "import matplotlib.pyplot as plt")
STACK = ("numpy", "pandas", "matplotlib", "PIL", "matplotlib_inline", "pyparsing", "kiwisolver",
         "cycler", "dateutil", "pytz", "fontTools", "contourpy", "scipy", "seaborn")
# The image ships seaborn and scipy: unpreloaded, `import seaborn, scipy.stats`
# cost a session 44 MB of private memory and 1.7 s (measured on the built image).
STATS_CELL = "import seaborn as sns\nimport scipy.stats"


@pytest.fixture(scope="module")
def dserver():
    with open(DATASCI) as f:
        shipped = json.load(f)
    host = sh.host_image_definition()
    definition = dict(host, name=IMAGE, zygote=True, preload=shipped["preload"],
                      env=dict(host.get("env", {}), **shipped.get("env", {})))
    srv, images = sh.start_server_with_image(
        definition, ["--pool", f"{IMAGE}=0", "--pool", "host=0"])
    yield srv
    problems = srv.shutdown()
    shutil.rmtree(images, ignore_errors=True)
    assert not problems, "\n".join(problems)


def test_the_shipped_preload_covers_a_plotting_cells_imports(dserver):
    sid, kc, _ = dserver.open_session(image=IMAGE)
    assert sh.is_forked(dserver.state_dir, sid), "python-datasci's sessions are forked"
    sh.run_ok(kc, "import sys\nbefore = set(sys.modules)")
    sh.run_ok(kc, PLOTTING_CELL)
    sh.run_ok(kc, STATS_CELL)
    new = sh.run_ok(kc, "print('\\n'.join(sorted(set(sys.modules) - before)))").split()
    stack = [m for m in new if m.split(".")[0] in STACK]
    assert not stack, f"a plotting cell imported what the zygote did not preload: {stack}"


def test_a_figure_still_shows_inline_after_pyplot_was_preloaded(dserver):
    sid, kc, _ = dserver.open_session(image=IMAGE)
    reply, msgs = sh.execute(kc, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\n"
                                 "plt.title('preloaded')")
    assert reply["content"]["status"] == "ok", reply["content"]
    pngs = [m["content"]["data"]["image/png"] for m in msgs
            if m["msg_type"] == "display_data" and "image/png" in m["content"]["data"]]
    assert len(pngs) == 1, [m["msg_type"] for m in msgs]
    import base64
    assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")


def test_the_host_images_warm_imports_leave_figures_inline(dserver):
    """The shipped `host` image's zygote warms numpy, pandas, matplotlib and
    pyplot (`warm_imports`, docs/images.md): a session finds them in
    sys.modules, bound in no namespace, without the inline backend (which
    must be imported after the kernel's shell exists), and its plot still
    shows as image/png at the end of the cell."""
    with open(os.path.join(sh.SOURCE_DIR, "images", "host", "image.json")) as f:
        warm = json.load(f)["warm_imports"]
    assert {"numpy", "pandas", "matplotlib.pyplot"} <= set(warm), warm
    sid, kc, _ = dserver.open_session(image="host")
    assert sh.is_forked(dserver.state_dir, sid)
    seen = json.loads(sh.run_ok(kc, "import sys, json\nprint(json.dumps({m: [m in sys.modules, "
                                    f"m.split('.')[0] in dir()] for m in {warm + ['matplotlib_inline.backend_inline']!r}}}))"))
    assert seen == dict({m: [True, False] for m in warm},
                        **{"matplotlib_inline.backend_inline": [False, False]}), seen
    reply, msgs = sh.execute(kc, "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])")
    assert reply["content"]["status"] == "ok", reply["content"]
    assert [m for m in msgs if m["msg_type"] == "display_data"
            and "image/png" in m["content"]["data"]], [m["msg_type"] for m in msgs]
