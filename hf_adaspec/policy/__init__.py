"""The policy: goodput math, acceptance and confidence models, the horizon, the controllers and the
registry of ``speculation=`` modes."""
