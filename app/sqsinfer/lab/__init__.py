"""The proving ground: a local AWS stand-in, synthetic models and inputs, the demo,
the chaos suite and the fault proxy. The worker core never imports it."""
