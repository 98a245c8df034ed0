"""The local demo mesh: every part on one machine in network namespaces (``adaptermesh demo``
and the end-to-end tests). It sits above the parts it starts and nothing in them imports it."""
