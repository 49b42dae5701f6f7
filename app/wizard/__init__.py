"""The guided job wizard: task, model, data, GPUs, plan, hyper-parameters, review, launch."""
