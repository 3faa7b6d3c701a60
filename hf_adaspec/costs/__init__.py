"""Costs: the measured cost table and its cache (``table``), the profile over batch × context × tokens
(``profile``, ``predictors``) and its measurement (``measure``)."""
