"""Training: REMORY's memory network on Ray Train + DeepSpeed (losses, the train step, the launcher, cached
teachers) and its data, built by the serving code; the relevance predictor's rows and trainer."""
