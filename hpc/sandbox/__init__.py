"""Running untrusted code: a fresh process with its own group, limits, no network and confined writes."""
