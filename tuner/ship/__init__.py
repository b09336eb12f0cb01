"""From the study's winner to production: the capacity plan and the alert rules, from what the study measured."""
