"""Calibration: running real text through the model and recording what its FFN neurons do."""
