terraform {
  # Terraform >= 1.5 or OpenTofu >= 1.6 (README, "Tested with").
  required_version = ">= 1.5"

  required_providers {
    nomad = {
      source  = "hashicorp/nomad"
      version = ">= 2.0"
    }
    consul = {
      source  = "hashicorp/consul"
      version = ">= 2.20"
    }
    random = {
      source  = "hashicorp/random"
      version = ">= 3.5"
    }
  }
}
