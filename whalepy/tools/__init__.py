"""User-facing tools built on the layers: the ``whalepy`` command, studies, calibration, export, plan
pictures, pseudo-to-real. Nothing below imports this folder."""
