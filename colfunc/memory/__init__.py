"""Memory accounting: what a rank's training state holds, and the peak of what a step allocates.

``report(state)`` counts the bytes of this rank's parameters, gradients and optimizer states (the
"model states" of the ZeRO paper). ``track()`` records the peak of live tensor bytes allocated
inside it, on the current thread, on any device (CPU included), so activation and ZeRO savings can
be measured without a GPU.

``chunks``, ``pool`` and ``placement`` are the parts of :func:`colfunc.offload`: model states in
fixed-size chunks, the device pool's exact account, and where chunks live under a budget;
``predict`` predicts an offloaded step's device peak and traffic by a dry run on the meta device.
"""

from colfunc.memory.predict import Prediction, predict
from colfunc.memory.report import MemoryReport, report
from colfunc.memory.track import Tracker, track

__all__ = ["MemoryReport", "Prediction", "Tracker", "predict", "report", "track"]
