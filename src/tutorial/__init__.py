"""The distributed PyTorch training workbook: one trainer per stage, and the helpers they share."""
__version__ = "0.1.0"
