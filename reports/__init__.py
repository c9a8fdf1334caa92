"""Study -> pandas -> plotly: one self-contained HTML report per study (``python -m tuner report``).

``data`` computes (pure functions of the study), ``figures`` draws, ``page`` lays out and
writes; ``browser`` checks a page in headless Chromium; ``benchmark`` times a 1,000-trial page.
"""

from reports.page import render_report, write_report

__all__ = ["render_report", "write_report"]
