"""Helpers the tests share (importable as ``support.<module>``: pytest puts test/ on the import
path, pyproject's ``pythonpath``): the scheduler simulator and a published ServerArgs per
SGLang release."""
