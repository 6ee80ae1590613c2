"""Faults and hostile input (issue 14): each case reproduces a finding and checks the fix."""
