"""Tests of the examples/ scripts, run the way their READMEs say."""
