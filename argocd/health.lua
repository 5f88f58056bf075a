-- Argo CD health for weightship.io/ModelRollout (resource.customizations.health.weightship.io_ModelRollout).
-- Phase mapping as in weightship.core.phase: Pending/Prefetching/Progressing -> Progressing,
-- Paused -> Suspended, Healthy -> Healthy, Degraded -> Degraded. An Aborted or InvalidSpec
-- condition that is True is Degraded whatever the phase says. Until the controller has observed
-- the latest spec (status.observedGeneration < metadata.generation) the rollout is Progressing.
-- Argo CD runs custom scripts without the string and math libraries: base functions only.
local hs = {}
local waiting = "Waiting for rollout spec update to be observed"

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = waiting
  return hs
end

local generation = tonumber(obj.metadata.generation)
local observed = tonumber(obj.status.observedGeneration)
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = waiting
  return hs
end

local message = obj.status.message
if message == nil then
  message = ""
end

if obj.status.conditions ~= nil then
  for _, condition in ipairs(obj.status.conditions) do
    if (condition.type == "Aborted" or condition.type == "InvalidSpec") and condition.status == "True" then
      hs.status = "Degraded"
      if message == "" and condition.message ~= nil then
        message = condition.message
      end
      hs.message = message
      return hs
    end
  end
end

local health = {
  Pending = "Progressing",
  Prefetching = "Progressing",
  Progressing = "Progressing",
  Paused = "Suspended",
  Healthy = "Healthy",
  Degraded = "Degraded",
}
local phase = obj.status.phase
if phase == nil then
  phase = "Pending"
end
if health[phase] == nil then
  hs.status = "Unknown"
  hs.message = "unknown phase " .. tostring(phase) .. ": " .. message
  return hs
end
hs.status = health[phase]
hs.message = message
return hs
