"""Tests of lowprec.plan: capacity planning."""
