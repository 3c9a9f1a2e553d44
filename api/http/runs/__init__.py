"""Work that outlives a request: caption / batch jobs and inferlet runs."""
