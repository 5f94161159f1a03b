// Copyright (c) llmgw contributors
// SPDX-License-Identifier: MPL-2.0

// Command fake-nvidia-gpu is a Nomad device plugin that reports nvidia/gpu
// devices which do not exist. It is a FAKE, for tests only: a machine without a
// GPU cannot run the real plugin (hashicorp/nomad-device-nvidia, which reads
// NVML), yet the scheduler's device placement and the environment a task gets
// from its reservation are what llmgw's GPU path depends on. See README.md.
//
// It copies what the real plugin shows Nomad: vendor "nvidia", type "gpu", one
// device group named after the GPU model, instance IDs shaped like NVML's GPU
// UUIDs, the attributes memory (MiB), driver_version, display_state and
// persistence_mode, and on Reserve the environment NVIDIA_VISIBLE_DEVICES=<the
// reserved IDs, comma-separated>. Devices, their count, name and memory come
// from the plugin's config block in the client agent's HCL:
//
//	plugin "fake-nvidia-gpu" {
//	  config {
//	    count      = 2
//	    name       = "Fake GPU 16GB"
//	    memory_mib = 16384
//	  }
//	}
//
// Built by devcluster/bootstrap.py inside a copy of the Nomad module it builds
// Nomad from, so the plugin SDK and its gRPC protocol are Nomad's own.
package main

import (
	"context"
	"crypto/sha256"
	"fmt"
	"strings"
	"sync"
	"time"

	log "github.com/hashicorp/go-hclog"

	"github.com/hashicorp/nomad/helper/pointer"
	"github.com/hashicorp/nomad/plugins"
	"github.com/hashicorp/nomad/plugins/base"
	"github.com/hashicorp/nomad/plugins/device"
	"github.com/hashicorp/nomad/plugins/shared/hclspec"
	"github.com/hashicorp/nomad/plugins/shared/structs"
)

const (
	// pluginName is also the binary's file name: Nomad matches a `plugin "<name>"`
	// block to the executable of that name in plugin_dir.
	pluginName    = "fake-nvidia-gpu"
	pluginVersion = "0.1.0"

	// What the real plugin reports (nomad-device-nvidia, device.go, fingerprint.go).
	vendor               = "nvidia"
	nvidiaVisibleDevices = "NVIDIA_VISIBLE_DEVICES"
	driverVersion        = "fake"
)

var (
	pluginInfo = &base.PluginInfoResponse{
		Type:              base.PluginTypeDevice,
		PluginApiVersions: []string{device.ApiVersion010},
		PluginVersion:     pluginVersion,
		Name:              pluginName,
	}

	configSpec = hclspec.NewObject(map[string]*hclspec.Spec{
		"count": hclspec.NewDefault(
			hclspec.NewAttr("count", "number", false), hclspec.NewLiteral("1")),
		"name": hclspec.NewDefault(
			hclspec.NewAttr("name", "string", false), hclspec.NewLiteral(`"Fake GPU"`)),
		"memory_mib": hclspec.NewDefault(
			hclspec.NewAttr("memory_mib", "number", false), hclspec.NewLiteral("16384")),
	})
)

// config is the plugin's config block.
type config struct {
	Count     int    `codec:"count"`
	Name      string `codec:"name"`
	MemoryMiB int64  `codec:"memory_mib"`
}

// fakeGpus is the device plugin: one group of identical fake GPUs.
type fakeGpus struct {
	logger log.Logger

	mu    sync.RWMutex
	group *device.DeviceGroup // nil until SetConfig, or with count 0
}

func main() {
	plugins.Serve(func(logger log.Logger) interface{} {
		return &fakeGpus{logger: logger.Named(pluginName)}
	})
}

func (d *fakeGpus) PluginInfo() (*base.PluginInfoResponse, error) { return pluginInfo, nil }

func (d *fakeGpus) ConfigSchema() (*hclspec.Spec, error) { return configSpec, nil }

// SetConfig builds the device group the config describes. Errors name the field.
func (d *fakeGpus) SetConfig(c *base.Config) error {
	cfg := config{Count: 1, Name: "Fake GPU", MemoryMiB: 16384}
	if len(c.PluginConfig) != 0 {
		if err := base.MsgPackDecode(c.PluginConfig, &cfg); err != nil {
			return err
		}
	}
	switch {
	case cfg.Count < 0:
		return fmt.Errorf("count: want 0 or more devices, got %d", cfg.Count)
	case strings.TrimSpace(cfg.Name) == "":
		return fmt.Errorf("name: want the GPU model's name, got an empty string")
	case cfg.MemoryMiB <= 0:
		return fmt.Errorf("memory_mib: want a positive number of MiB, got %d", cfg.MemoryMiB)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.group = nil
	if cfg.Count == 0 {
		return nil
	}
	devices := make([]*device.Device, cfg.Count)
	for i := range devices {
		devices[i] = &device.Device{
			ID:         fakeUUID(cfg.Name, i),
			Healthy:    true,
			HwLocality: &device.DeviceLocality{PciBusID: fmt.Sprintf("00000000:%02X:00.0", i+1)},
		}
	}
	d.group = &device.DeviceGroup{
		Vendor:  vendor,
		Type:    device.DeviceTypeGPU,
		Name:    cfg.Name,
		Devices: devices,
		Attributes: map[string]*structs.Attribute{
			"memory":           {Int: pointer.Of(cfg.MemoryMiB), Unit: structs.UnitMiB},
			"driver_version":   {String: pointer.Of(driverVersion)},
			"display_state":    {String: pointer.Of("Disabled")},
			"persistence_mode": {String: pointer.Of("Enabled")},
		},
	}
	d.logger.Info("fake GPUs configured", "count", cfg.Count, "name", cfg.Name,
		"memory_mib", cfg.MemoryMiB)
	return nil
}

// fakeUUID is a stable ID in NVML's GPU UUID shape ("GPU-8-4-4-4-12 hex"): the
// same config gives the same IDs across agent restarts, as real GPUs do.
func fakeUUID(name string, index int) string {
	sum := sha256.Sum256([]byte(fmt.Sprintf("%s/%d", name, index)))
	h := fmt.Sprintf("%x", sum[:16])
	return fmt.Sprintf("GPU-%s-%s-%s-%s-%s", h[0:8], h[8:12], h[12:16], h[16:20], h[20:32])
}

// Fingerprint reports the configured devices once and keeps the stream open
// until Nomad cancels it (a closed stream would read as "no devices").
func (d *fakeGpus) Fingerprint(ctx context.Context) (<-chan *device.FingerprintResponse, error) {
	out := make(chan *device.FingerprintResponse, 1)
	d.mu.RLock()
	if d.group != nil {
		out <- device.NewFingerprint(d.group)
	} else {
		out <- device.NewFingerprint()
	}
	d.mu.RUnlock()
	go func() {
		<-ctx.Done()
		close(out)
	}()
	return out, nil
}

// Reserve returns the environment the real plugin returns: NVIDIA_VISIBLE_DEVICES
// with the reserved IDs; an ID it never reported is an error, as there.
func (d *fakeGpus) Reserve(deviceIDs []string) (*device.ContainerReservation, error) {
	if len(deviceIDs) == 0 {
		return &device.ContainerReservation{}, nil
	}
	known := map[string]bool{}
	d.mu.RLock()
	if d.group != nil {
		for _, dev := range d.group.Devices {
			known[dev.ID] = true
		}
	}
	d.mu.RUnlock()
	var unknown []string
	for _, id := range deviceIDs {
		if !known[id] {
			unknown = append(unknown, id)
		}
	}
	if len(unknown) != 0 {
		return nil, fmt.Errorf("unknown device IDs: %s", strings.Join(unknown, ","))
	}
	return &device.ContainerReservation{
		Envs: map[string]string{nvidiaVisibleDevices: strings.Join(deviceIDs, ",")},
	}, nil
}

// Stats reports each device's memory as all free, every interval.
func (d *fakeGpus) Stats(ctx context.Context, interval time.Duration) (<-chan *device.StatsResponse, error) {
	out := make(chan *device.StatsResponse)
	go func() {
		defer close(out)
		ticker := time.NewTicker(interval)
		defer ticker.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-ticker.C:
			}
			select {
			case <-ctx.Done():
				return
			case out <- d.stats():
			}
		}
	}()
	return out, nil
}

func (d *fakeGpus) stats() *device.StatsResponse {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.group == nil {
		return &device.StatsResponse{}
	}
	now := time.Now()
	instances := map[string]*device.DeviceStats{}
	total := *d.group.Attributes["memory"].Int
	for _, dev := range d.group.Devices {
		instances[dev.ID] = &device.DeviceStats{
			Summary: &structs.StatValue{
				Unit: structs.UnitMiB, Desc: "memory used (fake: always 0)",
				IntNumeratorVal: pointer.Of(int64(0)), IntDenominatorVal: pointer.Of(total),
			},
			Timestamp: now,
		}
	}
	return &device.StatsResponse{Groups: []*device.DeviceGroupStats{{
		Vendor: d.group.Vendor, Type: d.group.Type, Name: d.group.Name, InstanceStats: instances,
	}}}
}
