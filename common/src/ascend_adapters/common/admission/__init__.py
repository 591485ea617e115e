"""Fail-closed artifact admission: manifests, checks and the serve-time hook.

Importing this package is cheap and never imports torch::

    from ascend_adapters.common.admission import build_manifest, check_dir
    manifest, report = build_manifest("/models/x")   # on a host you trust
    report = check_dir("/models/x", manifest)        # where you deploy
    assert report.ok, report.format()

See docs/admission.md.
"""

from ascend_adapters.common.admission.checks import (
    build_manifest,
    check_dir,
    dump_manifest,
    inspect_dir,
    load_manifest,
)
from ascend_adapters.common.admission.report import AdmissionError, Problem, Report

__all__ = [
    "AdmissionError",
    "Problem",
    "Report",
    "build_manifest",
    "check_dir",
    "dump_manifest",
    "inspect_dir",
    "load_manifest",
]
