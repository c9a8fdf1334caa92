"""Trial log -> pandas -> plotly: one self-contained HTML report per study (``python -m tuner report``).

The input is a study's trial log (``tuner.trials.trials_frame``) and a ``StudyInfo``; the
package never imports the tuner (the dependency runs tuner -> reports). ``data`` computes
(pure functions of the log), ``figures`` draws, ``page`` lays out and writes; ``bench``
draws the bench's figure; ``browser`` checks a page in headless Chromium; ``benchmark``
times a 1,000-trial page.
"""

from reports.data import StudyInfo
from reports.page import render_report, write_report

__all__ = ["StudyInfo", "render_report", "write_report"]
