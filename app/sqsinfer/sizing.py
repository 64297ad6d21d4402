"""How big a pod must be: its /dev/shm, its /tmp and its memory, from the settings that
drive them.

One formula, used by the Helm chart (`sqsinfer.sizing` in `_helpers.tpl`, held to this
module by a test), by `sqsinfer plan` and by docs/deployment.md. Every figure is in whole
MiB, each byte setting rounded up to whole MiB first:

    slots       = processes × in-flight per process
                  (the pinned prefetch, or max_prefetch when prefetch is auto)
    /dev/shm    = slots × max_input_bytes + shm headroom
    /tmp        = TMP_SCRATCH_MIB + max_model_bytes, the latter only when an s3:// model
                  is fetched into /tmp (model_dir empty or under /tmp)
    per process = PROCESS_BASELINE_MIB + the model's resident size
                  + DECODE_FACTOR × max_decoded_bytes + DECODE_SLACK_MIB
    memory      = MAIN_PROCESS_MIB + /dev/shm + processes × per process

Why each term:

- /dev/shm holds each in-flight input once, in a segment rounded up to whole MiB
  (`shm.Segments`), and never more segments than slots; the worker's auto prefetch
  never grows past what /dev/shm holds. A memory-backed emptyDir counts against the
  container's memory limit, so it is in `memory` too.
- Decoding an input costs at most 3 × the decoded array + 8 MiB beyond the input itself
  (tests/unit/test_decode_memory.py holds every format to it), and the decoded array is
  at most max_decoded_bytes whatever the format. Predictions and the encoded output come
  after the decoder's own buffers are freed and are smaller than the array.
- The baseline of an inference process (interpreter, numpy, the handler's library) and
  the worker's main process were measured in the image: see docs/deployment.md.

Pure arithmetic, no imports of the worker: the chart, the planner and the tests use it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

MIB = 1 << 20
MAIN_PROCESS_MIB = 130
PROCESS_BASELINE_MIB = 100
DECODE_FACTOR = 3
DECODE_SLACK_MIB = 8
TMP_SCRATCH_MIB = 64
SHM_HEADROOM_MIB = 64  # the chart's shm.headroomMiB default
MODEL_RESIDENT_MIB = 64  # the chart's model.residentMiB default

_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?")
_SUFFIX = {
    "m": Fraction(1, 1000),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}


def parse_quantity(text: str | int) -> int:
    """A Kubernetes quantity of bytes ("64Mi", "1.5G", 1024) as bytes, rounded up."""
    found = _QUANTITY.fullmatch(str(text).strip())
    if found is None:
        raise ValueError(f"not a quantity of bytes: {text!r} (e.g. 512Mi, 2Gi, 1000000)")
    number, suffix = found.groups()
    return math.ceil(Fraction(number) * _SUFFIX[suffix or ""])


def mib(size_bytes: int) -> int:
    """Bytes as whole MiB, rounded up."""
    return -(-size_bytes // MIB)


def model_in_tmp(model_path: str, model_dir: str) -> bool:
    """Whether the worker fetches the model into /tmp (an s3:// model, model_dir there)."""
    in_tmp = not model_dir or model_dir == "/tmp" or model_dir.startswith("/tmp/")
    return model_path.startswith("s3://") and in_tmp


@dataclass(frozen=True)
class PodSettings:
    """What a pod's sizes follow from; byte settings in bytes."""

    processes: int
    in_flight_per_process: int  # prefetch when pinned, max_prefetch when auto
    max_input_bytes: int
    max_decoded_bytes: int
    fetched_model_bytes: int = 0  # max_model_bytes when the model is fetched into /tmp
    model_resident_mib: int = MODEL_RESIDENT_MIB
    shm_headroom_mib: int = SHM_HEADROOM_MIB


@dataclass(frozen=True)
class PodSizing:
    settings: PodSettings
    slots: int
    shm_mib: int
    tmp_mib: int
    decode_mib: int
    per_process_mib: int
    memory_mib: int

    def explain(self) -> dict[str, str]:
        """Each size with the arithmetic behind it, for people (MiB throughout)."""
        s = self.settings
        model = f" + {mib(s.fetched_model_bytes)} for the model fetched from S3"
        return {
            "/dev/shm": (
                f"{self.shm_mib} MiB: {self.slots} in-flight inputs ({s.processes} processes "
                f"× {s.in_flight_per_process}) × {mib(s.max_input_bytes)} + "
                f"{s.shm_headroom_mib} headroom"
            ),
            "/tmp": (
                f"{self.tmp_mib} MiB: {TMP_SCRATCH_MIB} scratch"
                + (model if s.fetched_model_bytes else "")
            ),
            "memory": (
                f"{self.memory_mib} MiB: main process {MAIN_PROCESS_MIB} + /dev/shm "
                f"{self.shm_mib} + {s.processes} processes × ({PROCESS_BASELINE_MIB} baseline "
                f"+ {s.model_resident_mib} model + {self.decode_mib} to decode: "
                f"{DECODE_FACTOR} × {mib(s.max_decoded_bytes)} + {DECODE_SLACK_MIB})"
            ),
        }


def size(s: PodSettings) -> PodSizing:
    """The pod's sizes for these settings."""
    for name in ("processes", "in_flight_per_process", "max_input_bytes", "max_decoded_bytes"):
        if getattr(s, name) < 1:
            raise ValueError(f"{name} must be at least 1, not {getattr(s, name)}")
    slots = s.processes * s.in_flight_per_process
    shm = slots * mib(s.max_input_bytes) + s.shm_headroom_mib
    decode = DECODE_FACTOR * mib(s.max_decoded_bytes) + DECODE_SLACK_MIB
    per_process = PROCESS_BASELINE_MIB + s.model_resident_mib + decode
    return PodSizing(
        settings=s,
        slots=slots,
        shm_mib=shm,
        tmp_mib=TMP_SCRATCH_MIB + mib(s.fetched_model_bytes),
        decode_mib=decode,
        per_process_mib=per_process,
        memory_mib=MAIN_PROCESS_MIB + shm + s.processes * per_process,
    )
