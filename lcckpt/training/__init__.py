"""What runs beside a training loop: :class:`.manager.CheckpointManager`, its host
copies, RNG capture, loss curve and re-planning (the schedule itself is ``lcckpt.schedule``)."""
