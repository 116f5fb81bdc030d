"""FLUX 3 Image Klein's prompt upsampler: the model run (model.py), its box protocol (layout.py), its pictures
(pictures.py)."""
