"""`flover bench`: seeded workloads through fused / serial / window / instances / hf serving modes."""
