"""A mount point beneath the payload root (a bind mount of a folder outside it, or of one of its
own version folders) is refused: a read through it is a `PayloadHandleError` whether the root
follows symlinks or not, and a retention never deletes a file through such a second name. The
mounts are made in a private mount namespace (``unshare -m``), skipped where that needs
privileges this machine does not grant."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys
    import numpy as np
    from r3data.errors import PayloadHandleError
    from r3data.payload import PayloadReader, PayloadRetention, PayloadSegment, PayloadWriter

    base = sys.argv[1]
    root, outside = os.path.join(base, "root"), os.path.join(base, "outside")
    os.makedirs(outside)
    with open(os.path.join(outside, "secret.bin"), "wb") as f:
        f.write(bytes(range(8)))
    routes = np.arange(16, dtype=np.uint8).reshape(4, 2, 2)
    kept = PayloadWriter(root).write(7, {"routes": routes})[0]
    for folder, target in (("v0", outside), ("v5", os.path.join(root, "v7"))):
        os.makedirs(os.path.join(root, folder))
        subprocess.run(["mount", "--bind", target, os.path.join(root, folder)], check=True)
    report = {}
    for follow in (True, False):
        reader = PayloadReader(root, follow_symlinks=follow, retries=0)
        for handle in ("v0/secret.bin", "v5/" + os.path.basename(kept.file)):
            try:
                reader.read([PayloadSegment("routes", handle, 0, 0, 2, "uint8", (2, 2))])
                report[f"{follow} {handle[:2]}"] = "read"
            except PayloadHandleError as exc:
                report[f"{follow} {handle[:2]}"] = str(exc)
        report[f"{follow} own"] = reader.read([kept])["routes"].tolist() == routes.tolist()
    retention = PayloadRetention(root, 1, fresh=False)
    retention.claim(7, [kept.file])
    retention.on_policy_update(5)
    retention.on_policy_update(6)  # sweeps version 5: the bind mount of v7
    retention.wait()
    report["kept"] = os.path.exists(os.path.join(root, kept.file))
    retention.close()
    print(json.dumps(report))
    """
)


def test_mount_points_beneath_the_root_are_refused(tmp_path):
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot make a mount namespace here (unshare -m needs privileges)")
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    for follow in ("True", "False"):
        for folder in ("v0", "v5"):
            assert "lies on another mount than the payload root" in report[f"{follow} {folder}"]
        assert report[f"{follow} own"] is True
    assert report["kept"] is True
