"""Experiments: grid specs, the runner, reports and the results page."""
